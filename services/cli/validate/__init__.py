"""The parts of `prfaas validate-sim`, the simulation against the live mesh, a module per idea;
the command is services/cli/validation.py."""
