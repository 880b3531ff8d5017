"""Build hook: the package is pure Python; native helpers are declared here when present."""

from setuptools import setup

setup()
