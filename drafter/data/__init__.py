"""Conversations and tokens: the readers of every source format and the built-in sets
(sources), which format a record is in and the record as canonical chat messages (formats), a
conversation re-answered turn by turn (conversations), synthetic prompts written by the target
(synthetic), token files and the draft vocab map (tokens). Above core only."""
