from .cli import cli

cli(prog_name="python -m build_tools")
