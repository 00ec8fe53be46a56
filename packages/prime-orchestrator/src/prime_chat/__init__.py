"""``prime-chat``: verifiers' ``null`` chat loop run inside the env server instead of as a program per rollout.

A verifiers harness plugin (``harness = "prime-chat"``). A tool-less episode turn is one model call through the
rollout's interception endpoint, made in-process. An episode with tool servers runs verifiers' own ``null`` chat
program's loop (its MCP client, tool-call gate and compactor, loaded from the bundled program source) in-process
too, on a local runtime: no Python process per rollout, and no uv environment synced from the network (which
hangs on a host without internet: GPU nodes, clusters). Non-local runtimes run verifiers' program as ``null`` does.
"""

from prime_chat.harness import PrimeChatHarness, PrimeChatHarnessConfig

__all__ = ["PrimeChatHarness", "PrimeChatHarnessConfig"]
