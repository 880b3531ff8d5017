"""The serving benchmark: real workloads, cold/warm/mixed caches, the throughput-interactivity frontier.

``corpus`` (token streams), ``workload`` (requests), ``engine`` (the serving loop),
``metrics`` (figures of a run), ``memcap`` (a memory cgroup for the page-cache baseline),
``runner`` (the sweep) and ``report`` (table, JSON, plot). The command is ``engram-offload bench``.
"""
