"""Private instances of the servers Sluice talks to, for tests and the demo.

Each starts on a free port with its own data directory and never touches a system service.
"""
