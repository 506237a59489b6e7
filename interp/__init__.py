"""interp: HuggingFace models with our own eager and flash attention, hook points and activation cache.

    import interp
    model = interp.load_model("toy-induction", attn="flash")
    output, cache = model.run_with_cache(tokens)

Importing registers the attention keys ``interp_exact`` and ``interp_fused`` with transformers and does
nothing else.
"""

from hooks import HookedRootModule, HookPoint  # TransformerLens's hook points in a module of your own

from .attention import masks as _masks  # noqa: F401  (registers our attention and mask functions)
from .attention.paths import EAGER_KEY, FLASH_KEY
from .model.loading import BUNDLED, load_model
from .model.config import ModelConfig
from .model.hooked import HookedModel
from .model.compat import HookedTransformer
from .lens.circuits import LowRank
from .lens.resid import ModelCache
from . import utils
from .streaming import cache_kwarg, kv_cache_bytes, output_cache, stream_heads, stream_model, streaming_kv_bytes
from .runtime.progress import set_progress
from .runtime.threads import set_threads

__all__ = ["BUNDLED", "EAGER_KEY", "FLASH_KEY", "HookedModel", "HookedRootModule", "HookedTransformer", "HookPoint", "LowRank", "ModelCache", "ModelConfig", "load_model",
           "cache_kwarg", "kv_cache_bytes", "output_cache", "set_progress", "set_threads", "stream_heads",
           "stream_model", "streaming_kv_bytes", "utils"]
__version__ = "0.1.0"
