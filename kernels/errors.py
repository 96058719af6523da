"""The one error the kernels package raises on purpose: a bad argument, named, with its numbers."""

from __future__ import annotations


class KernelInputError(ValueError):
    """An argument of a kernel call has the wrong dtype, shape, device or values.

    `argument` is the parameter's name as it appears in the signature, so a caller (or a test) can
    tell which input was refused without parsing the message.
    """

    def __init__(self, argument: str, problem: str) -> None:
        self.argument = argument
        self.problem = problem
        super().__init__(f"{argument}: {problem}")
