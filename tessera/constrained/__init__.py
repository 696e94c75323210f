"""Constrained decoding: a request's JSON schema, regex or EBNF grammar becomes a per-token vocabulary mask.

grammar.py turns the request's constraint into llguidance's grammar text and checks it (frontend, cached by
content); matcher.py builds one matcher per request off the step loop and fills the step's token bitmask
(scheduler process); the sampler applies the bitmask to the whole batch (worker).
"""
