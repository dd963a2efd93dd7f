"""SD3 / SD3.5 (ComfyUI's `OpenAISignatureMMDITWrapper`): joint blocks over (context, x); the last block's context
output is None (it is "pre-only")."""
from . import Family, Stack

FAMILY = Family("sd3", frozenset({"OpenAISignatureMMDITWrapper"}), (
    Stack("joint_blocks", streams=(("context", 0), ("x", 1)), returns=("context", "x")),
))
