"""Speculative decoding: cheap proposers of draft tokens the target model verifies in one step.

The scheduler asks a `Proposer` for up to k draft tokens per running request (k from
`DraftLengthPolicy`), schedules them as part of "compute the next N tokens" (ARCHITECTURE.md,
rule 2), the runner scores every draft position in the same forward pass as the rest of the
batch (`verify.py`), and the scheduler keeps the accepted prefix plus one token.
"""
