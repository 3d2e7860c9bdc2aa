"""`python -m axoplan.cli ...`, as torchrun and srun start the trainer."""
from axoplan.cli.main import main

main()
