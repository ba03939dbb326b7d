"""The chaos test's parts (G3 under faults, README "Guarantees and limits"): an upstream wrapper that logs the exact commit
order at a real moto_server, lease-handing writers, a nemesis, and a pure history checker.

`test_chaos.py` puts them together; `checker.py` has no I/O and is unit-tested there.
"""
