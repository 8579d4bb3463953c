"""One module per sglpatch command, each of the same shape: NAME, HELP, optional DESCRIPTION,
register(parser) adds its options, run(args) returns the exit code. sglpatch.cli collects them in
one table (COMMANDS), grouped as --help shows them."""
