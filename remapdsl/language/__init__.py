"""The rule language: text -> frozen IR (lexer, builder, IR, checks, formatter, comments, includes)."""
