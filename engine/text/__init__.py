"""Text at the edge of the engine (ARCHITECTURE.md, rule 3): prompts in (tokenizing, validating,
expanding n), text out (detokenizing, stop strings); the core sees token ids only."""
