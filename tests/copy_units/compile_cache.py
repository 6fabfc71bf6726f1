# copies: compile_cache.py
# The per-runtime cache folder, then the cache on for this process: compiled graphs land on disk.
import sys
import warnings
from pathlib import Path
from compile_cache import cache_counters, compile_cache_dir, enable_compile_cache
loc = compile_cache_dir(environ={"XDG_CACHE_HOME": "/xdg"})
assert loc.path.parent == Path("/xdg/tpu-notebooks/xla-cache") and loc.persistent, loc
assert loc.path.name.startswith("torch_xla-2.") and loc.path.name.endswith("-cpu"), loc
assert "torch_xla" not in sys.modules  # choosing the folder reads env and sysfs only
folder = enable_compile_cache("cache")  # before the first computation of the process
import torch, torch_xla
x = (torch.arange(4.0, device=torch_xla.device()) * 3).sum()
assert x.item() == 18.0 and folder == Path("cache") and any(folder.iterdir())
assert all(k.startswith("PersistentCache") for k in cache_counters()), cache_counters()
with warnings.catch_warnings(record=True) as caught:  # too late now: a warning, never an error
    warnings.simplefilter("always")
    assert enable_compile_cache("again") is None
assert "already compiled" in str(caught[0].message)
print("ok")
