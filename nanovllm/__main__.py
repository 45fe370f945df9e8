"""`python -m nanovllm serve MODEL [options]`: see nanovllm/entrypoints/cli.py."""
import sys

if __name__ == "__main__":
    from nanovllm.entrypoints.cli import main

    sys.exit(main())
