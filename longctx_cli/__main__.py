"""`python -m longctx_cli` is the `longctx` command (torchrun starts ranks this way)."""

from longctx_cli.cli import main

main()
