"""The `indknn` command line: one thin module per command (parse, call one library function, print)."""
