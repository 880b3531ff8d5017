"""Byte sizes and the argparse validators of ``units``."""

from __future__ import annotations

import argparse

import pytest

from engram_offload.units import (
    MAX_SIZE,
    finite_float,
    format_bytes,
    fraction,
    int_in_range,
    non_negative_float,
    non_negative_int,
    parse_size,
    positive_float,
    positive_int,
    size_arg,
    size_or_percent_arg,
    unit_interval,
)


@pytest.mark.parametrize("text,whole,expected", [
    ("512M", None, 512 << 20), ("2G", None, 2 << 30), ("1.5GiB", None, 3 << 29), ("1kb", None, 1024),
    (" 7 ", None, 7), (4096, None, 4096), ("0.5K", None, 512), ("1.1G", None, 1181116006), ("3.0", None, 3), ("10%", 1000, 100), ("0%", 1000, 0), ("100%", 3, 3),
])
def test_parse_size_accepts(text, whole, expected):
    assert parse_size(text, whole) == expected


@pytest.mark.parametrize("text,whole,match", [
    ("inf%", 1000, "finite"), ("nan%", 1000, "finite"), ("-5%", 1000, "finite"), ("inf", None, "not understood"),
    ("nan", None, "not understood"), ("-1", None, "negative"), ("-1G", None, "negative"), (-1, None, "negative"),
    ("0.5", None, "not a whole number of bytes"), ("1.5", None, "not a whole number"),
    ("0.0001K", None, "less than one byte"),
    ("2000000T", None, "over"), (MAX_SIZE + 1, None, "over"), ("1e400%", 1000, "finite"),
    ("10%", None, "percentage"), ("x%", 10, "number followed by %"), ("", None, "not understood"),
    (True, None, "not a number"),
])
def test_parse_size_refuses(text, whole, match):
    with pytest.raises(ValueError, match=match):
        parse_size(text, whole)


def test_format_bytes():
    assert format_bytes(2254857830) == "2.1 GiB" and format_bytes(12) == "12 B"
    assert format_bytes(3 << 60) == "3.0 EiB"
    assert format_bytes(4 << 20) == "4.0 MiB" and format_bytes(1536) == "1.5 KiB" and format_bytes(1023) == "1023 B"


@pytest.mark.parametrize("parse,good,bad", [
    (finite_float, {"-2.5": -2.5, "0": 0.0}, ["nan", "inf", "-inf", "x", ""]),
    (positive_float, {"1e-3": 1e-3, "50": 50.0}, ["0", "-10", "nan", "inf", "1e999"]),
    (non_negative_float, {"0": 0.0, "2.5": 2.5}, ["-0.1", "nan", "inf"]),
    (fraction, {"1": 1.0, "2e-5": 2e-5}, ["0", "1.5", "nan", "-1"]),
    (unit_interval, {"0": 0.0, "1": 1.0}, ["1.01", "-0.01", "nan"]),
    (positive_int, {"1": 1, "64": 64}, ["0", "-3", "1.5", "nan", "x"]),
    (non_negative_int, {"0": 0}, ["-1", "2.0"]),
    (int_in_range(1, 10), {"10": 10}, ["0", "11"]),
    (size_arg, {"2G": 2 << 30}, ["inf", "-1", "10%", "1e30"]),
    (size_or_percent_arg, {"2G": "2G", "20%": "20%"}, ["inf%", "nan%", "-5%", "x", "2000000T"]),
])
def test_validators(parse, good, bad):
    for text, value in good.items():
        assert parse(text) == value
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


def test_validator_errors_are_usage_errors(capsys):
    parser = argparse.ArgumentParser(prog="p")
    parser.add_argument("--n", type=positive_int)
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--n", "0"])
    assert exc.value.code == 2
    assert "'0' is not an integer >= 1" in capsys.readouterr().err
