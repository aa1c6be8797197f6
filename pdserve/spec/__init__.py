"""Speculative decoding: proposers guess a request's next tokens, the model runner verifies them in one
step (`pdserve.runner.sampler.Sampler.verify`), and the scheduler keeps what was accepted.

`SpeculativeExecutor` wraps any `Executor`: after each step it records how many drafts were accepted,
picks each request's next speculation length (`SpecLengthController`, and `choose_lengths` where the
slack rule runs) and asks a `Proposer` for that many drafts, which travel to the scheduler in
`ModelOutput.spec_token_ids`. Torch-free, except
`pdserve.spec.draft` (the draft-model proposer, which runs a model; imported where it is built).
"""

from pdserve.spec.executor import SpeculativeExecutor, make_proposer
from pdserve.spec.length import SpecLengthController, StepCost, choose_lengths
from pdserve.spec.ngram import NgramProposer
from pdserve.spec.proposer import DraftRequest, Proposer
from pdserve.spec.stats import SpecDecodeStats

__all__ = [
    "DraftRequest",
    "NgramProposer",
    "Proposer",
    "SpecDecodeStats",
    "SpecLengthController",
    "SpeculativeExecutor",
    "StepCost",
    "choose_lengths",
    "make_proposer",
]
