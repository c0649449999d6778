"""Adapters the server serves: a resolver interface (name -> local directory), path
confinement, and the server's registry over the engine's.

Rules the registry keeps:
- Runtime paths (POST /v1/load_lora_adapter, LoRAX `adapter_source="local"`, names looked up
  in --adapter-dir) resolve, symlinks followed, to a directory under the adapter directory;
  anything else is refused (`AdapterPathError`) unless `allow_any` is set.
- A name that is not registered is resolved and loaded on first use; loads are serialized,
  so two requests for one new adapter load it once.
- An unload waits for the requests that use the adapter to finish; from its start, new
  requests for that name are answered 404.
- A merge of adapters (LoRAX's `merged_adapters`) is registered on first use under a name
  made from its spec ("merged-" and a digest), kept for the next request that asks for it,
  and not listed among the served models. At most MAX_MERGED stay registered: past that, the
  least recently used one no request uses goes. Unloading an adapter unloads the merges that
  hold it, so a name loaded again never serves an old merge.
"""

from __future__ import annotations

import abc
import asyncio
import hashlib
import json
from collections import Counter, OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

from slora.server.errors import APIError

if TYPE_CHECKING:
    from slora.async_engine import AsyncEngine
    from slora.model.merge import MergeSpec

MAX_MERGED = 16  # merged adapters kept registered


class AdapterPathError(ValueError):
    """A path outside what the server may read."""


class AdapterResolver(abc.ABC):
    """Finds an adapter's local PEFT directory by name. A remote store plugs in here: fetch
    the adapter into a local directory and return that directory."""

    @abc.abstractmethod
    def resolve(self, name: str) -> Path | None:
        """The local directory of adapter `name`, or None if this resolver does not know it.
        Raises AdapterPathError for a name that points outside what it may read."""


def confine(path: str | Path, root: str | Path | None, allow_any: bool = False) -> Path:
    """`path` resolved (a relative one taken under `root`), symlinks followed. Unless
    `allow_any`, it must lie under `root` after resolution: `..` and symlinks out of it are
    refused."""
    given = Path(path).expanduser()
    if root is None and not allow_any:
        raise AdapterPathError("adapter paths need --adapter-dir DIR (paths under it) or "
                               "--allow-any-adapter-path")
    if not given.is_absolute():
        if root is None:
            raise AdapterPathError(f"relative adapter path {str(path)!r} needs --adapter-dir")
        given = Path(root) / given
    resolved = given.resolve()
    if not allow_any and not resolved.is_relative_to(Path(root).resolve()):
        raise AdapterPathError(f"adapter path {str(path)!r} resolves outside the adapter "
                               f"directory {str(root)!r}: refused (--allow-any-adapter-path "
                               "lifts this)")
    return resolved


class LocalDirResolver(AdapterResolver):
    """Adapter `name` is the PEFT directory `root/name` (a relative path; with `allow_any`,
    an absolute path anywhere), if it has an adapter_config.json."""

    def __init__(self, root: str | Path, allow_any: bool = False) -> None:
        self.root = Path(root)
        self.allow_any = allow_any

    def resolve(self, name: str) -> Path | None:
        path = confine(name, self.root, self.allow_any)
        return path if (path / "adapter_config.json").is_file() else None


def read_chat_template(path: str | Path) -> str | None:
    """An adapter directory's own chat template: chat_template.jinja, else the
    chat_template of its tokenizer_config.json; None if it has neither."""
    d = Path(path)
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text()
    conf = d / "tokenizer_config.json"
    if conf.is_file():
        template = json.loads(conf.read_text()).get("chat_template")
        return template if isinstance(template, str) else None
    return None


class ServedAdapters:
    """The server's view of the engine's adapters (see the module docstring for its rules).
    All methods run on the server's event loop; engine calls go to a worker thread."""

    def __init__(self, engine: "AsyncEngine", base_name: str, resolver: AdapterResolver | None,
                 adapter_dir: str | None, allow_any: bool) -> None:
        self.engine = engine
        self.base_name = base_name
        self.resolver = resolver
        self.adapter_dir = adapter_dir
        self.allow_any = allow_any
        registered = engine.call(lambda: {n: i.source for n, i in
                                          engine.engine.adapters.adapters.items()})
        self.templates = {n: _template_of(src) for n, src in registered.items()}
        self.users: Counter[str] = Counter()  # running HTTP requests per adapter
        self.unloading: set[str] = set()
        self.merged: OrderedDict[str, tuple[str, ...]] = OrderedDict()  # name -> its parts
        self._lock = asyncio.Lock()

    def names(self) -> list[str]:
        """The adapters served by name (merges are not)."""
        return sorted(n for n in self.templates if n not in self.merged)

    async def merge(self, spec: "MergeSpec", param: str) -> str:
        """The name of the merge `spec` of adapters (each loaded first if need be), registered
        on first use and counted in use until `release`. 404 for an unknown part; 400 for
        parts that do not merge."""
        name = "merged-" + hashlib.sha256(repr(spec).encode()).hexdigest()[:16]
        if name not in self.templates:
            held = []
            try:
                for part in spec.adapters:
                    await self.acquire(part, param)
                    held.append(part)
                async with self._lock:
                    if name not in self.templates:
                        await self._add_merged(name, spec, param)
            finally:
                for part in held:
                    self.release(part)
        if name in self.unloading or name not in self.templates:
            raise APIError(404, f"a part of merged adapter {name!r} is being unloaded", param)
        self.merged.move_to_end(name)
        self.users[name] += 1
        return name

    async def _add_merged(self, name: str, spec: "MergeSpec", param: str) -> None:
        idle = [m for m in self.merged if not self.users[m] and m not in self.unloading]
        for old in idle[:max(0, len(self.merged) + 1 - MAX_MERGED)]:  # least recent first
            await self._remove(old)
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, self.engine.add_merged_adapter, name, spec)
        except KeyError as e:
            raise APIError(404, str(e.args[0]) if e.args else str(e), param) from None
        except ValueError as e:  # AdapterError is a ValueError
            raise APIError(400, f"adapters {list(spec.adapters)} cannot be merged: {e}",
                           param) from None
        self.templates[name] = None
        self.merged[name] = spec.adapters

    async def acquire(self, name: str, param: str = "model") -> None:
        """Count one more request on `name`, loading it first if the resolver finds it.
        404 for a name no one knows or one being unloaded; 403 for a path escape."""
        if name in self.unloading:
            raise APIError(404, f"adapter {name!r} is being unloaded", param)
        if name not in self.templates:
            path = self._resolve(name, param)
            async with self._lock:
                if name not in self.templates:  # another request may have loaded it meanwhile
                    await self._add(name, path, param)
            if name in self.unloading or name not in self.templates:
                raise APIError(404, f"adapter {name!r} is being unloaded", param)
        self.users[name] += 1

    def release(self, name: str) -> None:
        self.users[name] -= 1
        if self.users[name] <= 0:
            del self.users[name]

    def _resolve(self, name: str, param: str) -> Path:
        known = ", ".join([repr(self.base_name)] + [repr(n) for n in self.names()[:20]])
        if self.resolver is None:
            raise APIError(404, f"unknown model or adapter {name!r}; served: {known}", param)
        try:
            path = self.resolver.resolve(name)
        except AdapterPathError as e:
            raise APIError(403, str(e), param) from None
        if path is None:
            raise APIError(404, f"unknown model or adapter {name!r}: not registered and not "
                           f"found by the adapter resolver; served: {known}", param)
        return path

    async def load(self, name: str, path: str, inplace: bool = False) -> None:
        """Register adapter `name` from `path` (confined to the adapter directory). With
        `inplace` (vLLM's load_inplace) a loaded `name` is unloaded first (its running
        requests finish on the old weights); should the new weights fail to load, the name
        stays unloaded and the error says why."""
        if not name:
            raise APIError(400, "lora_name must be non-empty", "lora_name")
        try:
            resolved = confine(path, self.adapter_dir, self.allow_any)
        except AdapterPathError as e:
            raise APIError(403, str(e), "lora_path") from None
        if inplace and name in self.templates and name not in self.merged:
            if not resolved.is_dir():
                raise APIError(404, f"adapter directory {str(path)!r} does not exist",
                               "lora_path")
            await self.unload(name)
        async with self._lock:
            if name in self.templates or name in self.unloading:
                raise APIError(400, f"adapter {name!r} is already loaded; unload it first",
                               "lora_name")
            await self._add(name, resolved, "lora_path")

    async def _add(self, name: str, path: Path, param: str) -> None:
        if name == self.base_name:
            raise APIError(400, f"adapter name {name!r} is the base model's name", param)
        if not path.is_dir():
            raise APIError(404, f"adapter directory {str(path)!r} does not exist", param)
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, self.engine.add_adapter, name, str(path))
        except (ValueError, OSError) as e:  # AdapterError is a ValueError
            raise APIError(400, f"adapter {name!r} at {str(path)!r} cannot be loaded: {e}",
                           param) from None
        self.templates[name] = read_chat_template(path)

    async def unload(self, name: str) -> None:
        """Unregister `name` once the requests that use it have finished."""
        if name not in self.templates or name in self.unloading:
            raise APIError(404, f"adapter {name!r} is not loaded", "lora_name")
        self.unloading.add(name)
        try:
            while self.users[name]:
                await asyncio.sleep(0.02)
            await self._remove(name)
        finally:
            self.unloading.discard(name)
        for merge in [m for m, parts in self.merged.items() if name in parts]:
            if merge not in self.unloading:
                await self.unload(merge)

    async def _remove(self, name: str) -> None:
        """Unregister `name` from the engine and from here (no request uses it)."""
        self.users.pop(name, None)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.engine.remove_adapter, name)
        del self.templates[name]
        self.merged.pop(name, None)


def _template_of(source: str) -> str | None:
    """The chat template of a registered adapter's source directory (None for synthetic
    adapters, which have no directory)."""
    return read_chat_template(source) if Path(source).is_dir() else None
