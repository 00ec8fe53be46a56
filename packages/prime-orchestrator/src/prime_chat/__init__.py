"""``prime-chat``: verifiers' ``null`` chat loop run inside the env server instead of as a program per rollout.

A verifiers harness plugin (``harness = "prime-chat"``). A tool-less episode turn is one model call through the
rollout's interception endpoint, made in-process: no program is launched, so a single-turn or multi-turn ``Env``
episode costs what its model calls cost. An episode with tool servers runs verifiers' own ``null`` program,
unchanged, but on a local runtime with the env server's interpreter (which has the program's dependencies)
instead of a uv script environment: verifiers would bootstrap uv and sync the script's dependencies from the
network, which hangs on a host without internet (GPU nodes, clusters).
"""

from prime_chat.harness import PrimeChatHarness, PrimeChatHarnessConfig

__all__ = ["PrimeChatHarness", "PrimeChatHarnessConfig"]
