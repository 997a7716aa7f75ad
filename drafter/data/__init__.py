"""Conversations and tokens: the readers of every source format and the built-in sets
(sources), synthetic prompts written by the target (synthetic), token files and the draft vocab
map (tokens). Above core only."""
