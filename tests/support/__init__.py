"""What the tests share: helpers and stand-ins (an S3 proxy that injects faults, the sidecar as a
child process, broken adapters, signing keys, waiting on a condition). Tests and conftest.py
files import them from here; conftest.py files hold fixtures only."""
