"""The `axoplan` command: main.py assembles the groups; one module per command group."""
