"""The bundled 4D-parallel trainer (torch). Modules import torch themselves; this package file
does not, so `axoplan.runtime.goldfish` and `axoplan.runtime.checks` stay torch-free."""
