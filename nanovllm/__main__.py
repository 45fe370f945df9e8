"""`python -m nanovllm serve MODEL ...`: see nanovllm/entrypoints/cli.py."""

if __name__ == "__main__":
    from nanovllm.entrypoints.cli import main

    raise SystemExit(main())
