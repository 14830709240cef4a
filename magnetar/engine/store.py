"""The context cache's lower tiers: host memory (:class:`HostTier`, ``runtime.host_cache_mb``: what the device
cache evicts) and disk, where encoded contexts outlive the process (:class:`ContextStore`, ``runtime.context_store``,
``magnetar serve --context-store DIR``).

Each rank writes its own shard of a context it encoded -- one safetensors file per context and rank (every layer's
``k``, ``v``, ``pos``; the context's ids) and a JSON manifest written after it (its size and xxh3 checksum, the
weights' fingerprint, the encoding options' digest, the rank layout, the context's length and prefix digest) -- under
``DIR/<layout>/`` (``cp0of2-tp0of1``, or ``simulated-cp2``). A restarted server, or one whose memory cache evicted
the context, loads it back instead of running Phase 1 again: when every rank of the replica finds its file valid
(one gather of flags: the ranks must agree, or all encode). A context whose longest stored prefix is there (an
earlier turn of a conversation) is loaded and extended, as a cached prefix is.

A context that extended a stored one (``Encoder.extend``: a conversation's next turn) is written as what it adds --
each layer's entries after its parent's on this rank (an extension writes its KV after its base's: the first
entries of its shard are the base's) --, its manifest naming the parent and both entry counts; a load reads the chain
from its first, whole, file on -- or, where the engine holds the parent already (:meth:`ContextStore.parent`), the
file alone, whose entries it writes after the parent's (``Encoder._rejoined``). A parent is evicted only after the
files that continue it; one whose parent is gone can never load and is removed.

What is never loaded, named in the log: a file without its manifest (the process died while writing: the data file
goes to a temporary name first and is renamed, then the manifest), a file whose size or checksum differs from its
manifest (truncated, corrupt) -- both deleted --, and a foreign one (other weights: another fingerprint; another
layout or format) -- left for its owner, and replaced when this engine encodes the same context.

The store is bounded (``runtime.context_store_mb``) as a whole folder: every rank's files and every other layout's
together. Each of a replica's N ranks keeps 1/N of what the other layouts' and weights' files (measured when it
opens) leave of the bound (1/(N x D) with D data-parallel replicas, which write the same folders; each replica
counts and evicts only the files it wrote, and loads the others' too, those written since it opened the folder
included: :meth:`ContextStore._refresh`) -- said in the log, by folder, when they take
more than half of it --, each context counted at
:attr:`~magnetar.engine.context.ContextHandle.nbytes` (what a process holds for it, the same on every rank, so the
ranks evict alike; less its parent's for a file that continues one), the least recently used out *before* a
write, so the folder never grows past the bound. Pinned contexts (``POST /v1/contexts``) are not evicted until
released -- by any replica: another replica's pins (its ``pinned-r<replica>.pins``) are read before an eviction.
A write that would leave less than :data:`KEEP_FREE` free on the disk is skipped (said once). Writes run
on a background thread (a context's tensors are never changed once encoded), so a request does not wait for the
disk; :meth:`ContextStore.flush` waits for them; a failed write leaves no file behind. A writer holds a lock
(``flock``) on its manifest's temporary file from before the data is written until the manifest is in place: a
store opening the same folder (a data-parallel replica starting, a restart while the old process still writes)
leaves a context being written alone and removes only what a dead writer left -- the kernel releases a killed
process's locks.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import queue
import re
import shutil
import threading
import time
import uuid
import weakref
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

log = logging.getLogger(__name__)

FORMAT = 2  # 2: a context may be stored as what it adds to its parent's (format 1's files, each whole, still load)
READS = (1, 2)
_TMP = ".tmp-"  # a file being written: <name>.tmp-<uuid>, renamed when complete (stale ones removed at start)
_LIB_TMP = ".tmp"  # safetensors' own temporary file (it writes one beside the target and renames it)
_CHUNK = 1 << 22  # bytes hashed per read
KEEP_FREE = 1 << 30  # a write that would leave less free space on the store's disk is skipped
RACY_NS = 10**9  # a folder's mtime this recent may yet be followed by a change that leaves it equal (_refresh)
_PINS = ".pins"  # pinned-r<replica>.pins: a data-parallel replica's pinned keys, which the others do not evict


def weights_fingerprint(model) -> str:
    """A short, stable name of ``model``'s weights on this rank: its class, its config (less the path it came
    from) and, per parameter and buffer, the name, shape, dtype and a strided sample of at most 4096 values -- other
    weights (another checkpoint, a fine-tune, another TP slice) give another fingerprint, for a read of ~4K values
    per tensor instead of a hash of every byte."""
    h = hashlib.blake2b(digest_size=12)
    h.update(type(model).__name__.encode())
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        d = {k: v for k, v in config.to_dict().items() if k not in ("_name_or_path", "name_or_path")}
        h.update(json.dumps(d, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            step = max(1, t.numel() // 4096)
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
            # every step-th value in the tensor's logical order, read where it lies (a weight stored transposed for
            # the CPU's decode, magnetar.engine.gemv, is not copied whole to be sampled)
            at = torch.arange(0, t.numel(), step, device=t.device)[:4096]
            sample = t.detach()[torch.unravel_index(at, t.shape)] if t.dim() else t.detach().reshape(1)
            h.update(sample.to("cpu", torch.float64).numpy().tobytes())
    return h.hexdigest()


def layout_name(simulated: bool, cp_rank: int, cp_size: int, tp_rank: int = 0, tp_size: int = 1) -> str:
    """The store folder of one rank's layout: ``simulated-cp4`` (one process holds every rank's KV) or
    ``cp1of4-tp0of1``."""
    return f"simulated-cp{cp_size}" if simulated else f"cp{cp_rank}of{cp_size}-tp{tp_rank}of{tp_size}"


def replica_layouts(simulated: bool, cp_size: int, tp_size: int = 1) -> tuple[str, ...]:
    """The store folders of every rank of a replica (they share the store's bound)."""
    if simulated:
        return (layout_name(True, 0, cp_size),)
    return tuple(layout_name(False, c, cp_size, t, tp_size) for c in range(cp_size) for t in range(tp_size))


def _longest(candidates, length: int, prefix_of) -> int:
    """The longest ``n`` of ``candidates`` ``(n, hex digest of n tokens)`` shorter than ``length`` whose digest
    ``prefix_of(n)`` matches (0: none) -- a tier's longest stored proper prefix of a context."""
    for n, digest in sorted({(n, d) for n, d in candidates if n < length}, reverse=True):
        if prefix_of(n) == digest:
            return n
    return 0


HASH = "xxh3_128"  # a data file's checksum: xxHash's XXH3, 128 bits (~20 GB/s on a core, where blake2b ran ~1 GB/s)
HASHES = ("xxh3_128", "blake2b")  # what a manifest may name ("hash"; none: blake2b, as format 1 and early 2 wrote)


def _data_problem(data: Path, m: dict, checksum: bool = True) -> Optional[tuple[str, bool]]:
    """Why the data file ``data`` is not what its manifest ``m`` says, and whether it is to be removed (a partial or
    corrupt file is; one of a checksum kind this engine does not know is left), or None: its size, then (with
    ``checksum``) its checksum."""
    if not data.exists():
        return f"its data file is missing (its manifest says {m.get('bytes')} bytes)", True
    size = data.stat().st_size
    if size != m.get("bytes"):
        return (f"its data file holds {size} bytes, its manifest says {m.get('bytes')} (truncated, or the writer "
                f"died)", True)
    if not checksum:
        return None
    kind = m.get("hash", "blake2b")
    if kind not in HASHES:
        return f"its checksum is of a kind this engine does not know ({kind!r})", False
    if _checksum(data, kind) != m.get("checksum"):
        return "its checksum differs from its manifest's (corrupt)", True
    return None


def _checksum(path: Path, kind: str = HASH) -> str:
    """The checksum of the file at ``path`` (one of :data:`HASHES`): truncation and corruption, not an adversary."""
    if kind == "xxh3_128":
        import xxhash

        h = xxhash.xxh3_128()
    else:
        h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                return h.hexdigest()
            h.update(chunk)


@dataclass
class Entry:
    """A stored context of this rank's layout, as its manifest says."""

    key: str
    tokens: int
    prefix: str  # the prefix digest of its ids (magnetar.engine.context.prefix_digest, hex)
    options: str  # the encoding options' digest
    nbytes: int  # what the budget counts: what a process holds for it (ContextHandle.nbytes), less its parent's
    used: float  # last written or loaded (seconds since the epoch)
    parent: Optional[str] = None  # the stored context whose KV this one's file continues (None: the file is whole)
    kv: Optional[tuple] = None  # this rank's KV entries per layer, the parent's included (None: not said, format 1)
    owner: int = 0  # the data-parallel replica that wrote it (manifest "replica"; 0 when not said): it alone evicts it

    @classmethod
    def of(cls, m: dict) -> "Entry":
        """The entry a manifest ``m`` describes (KeyError, ValueError or TypeError when it is not one)."""
        return cls(m["key"], int(m["tokens"]), m["prefix"], m["options"], int(m["nbytes"]), float(m["used"]),
                   m.get("parent"), None if m.get("kv") is None else tuple(m["kv"]), int(m.get("replica", 0)))


@dataclass
class Link:
    """The context a handle extended (``Encoder.extend``), as the store needs it to write only the new KV: its
    ``key``, this rank's KV entries per layer (``kv``: the first entries of the handle's shard) and its ``nbytes``
    (the same on every rank, so the ranks count the new file alike)."""

    key: str
    kv: tuple
    nbytes: int


class ContextStore:
    """One rank's disk tier under ``root/layout`` (module docstring), for the weights ``fingerprint``. The folder
    ``root`` holds at most ``bound_bytes``; ``peers``: the layout folders of this rank's replica (itself among them),
    which share what the other files under ``root`` leave of it with the ``replicas`` data-parallel replicas writing
    the same folders (this rank's part: :attr:`budget_bytes`). ``replica``: this rank's data-parallel replica. Each
    replica counts and evicts only the files it wrote (their manifests name it) -- the others' it may load, never
    removes -- so a restart of several replicas keeps every replica's share (each counting every file of the folder
    as its own would cut the store to 1/``replicas`` of it), and a turn's file continues only its own replica's."""

    def __init__(self, root, layout: str, fingerprint: str, bound_bytes: int, peers: tuple = (), replicas: int = 1,
                 replica: int = 0):
        self.root, self.dir = Path(root), Path(root) / layout
        self.layout, self.fingerprint, self.bound_bytes = layout, fingerprint, bound_bytes
        self.replica, self.replicas = replica, replicas
        peers = set(peers) | {layout}
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"runtime.context_store {str(root)!r}: cannot create {self.dir} ({e}); give a writable "
                             f"folder (--context-store DIR)") from None
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, Entry] = OrderedDict()  # least recently used first
        self._pinned: set[str] = set()
        self._their_pins: set[str] = set()  # the keys the other data-parallel replicas pinned (their .pins files)
        self.loads = self.writes = self.evictions = self.refused = self.skipped = 0
        self._stamp: Optional[int] = None  # the folder's mtime when last indexed (_refresh)
        self._passed: set[str] = set()  # manifests read and left out of the index (foreign, unreadable)
        self._scan()
        with self._lock:
            self._refresh()  # the other replicas' pins (and what they wrote during the scan); sets _stamp
        self.budget_bytes = max(0, bound_bytes - self._others(peers)) // (len(peers) * max(1, replicas))
        self._low_disk_said = False
        for key in self._make_room(0) or ():  # a smaller share than what this layout left (a lower bound, others')
            self._delete(key)
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="magnetar-context-store", daemon=True)
        self._writer.start()

    # -- the index ----------------------------------------------------------------------------------------------
    def _scan(self) -> None:
        """Index the manifests of this layout; remove what a killed writer left (temporary files, data without a
        manifest)."""
        found = []
        for path in self.dir.iterdir():
            # what another process is writing here (a replica, an old server) is left to it -- asked when a file is
            # found (a writer locks before it writes anything), so a write begun during the scan is seen too
            if _TMP in path.name or path.name.startswith(_LIB_TMP):
                writing = _being_written(self.dir)  # rare: a dead writer's leftovers, or a live one's files
                # safetensors' own temporary file names no context: removed only when no one writes here
                if path.name.split(".")[0] not in writing and (_TMP in path.name or not writing):
                    path.unlink(missing_ok=True)
                continue
            if path.suffix == ".safetensors" and not path.with_suffix(".json").exists():
                # the manifest asked again after the locks: a writer renames it into place before it unlocks
                if path.stem not in _being_written(self.dir) and not path.with_suffix(".json").exists():
                    log.warning("context store: %s has no manifest (its writer died): removed", path)
                    path.unlink(missing_ok=True)
                continue
            if path.suffix != ".json":
                continue
            try:
                m = json.loads(path.read_text())
                entry = Entry.of(m)
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning("context store: manifest %s is unreadable (%s): removed with its data", path, e)
                self._delete(path.stem)
                continue
            if not self._ours(m):
                continue  # foreign: another engine's (left for it)
            found.append(entry)
        keys = {e.key for e in found}
        while True:  # a file whose parent is gone (removed by hand, or damaged) can never load: removed
            orphans = [e for e in found if e.parent is not None and e.parent not in keys]
            if not orphans:
                break
            for e in orphans:
                log.warning("context store: %s continues %s, which is not stored: removed",
                            self.dir / f"{e.key}.safetensors", e.parent)
                self._delete(e.key)
                keys.discard(e.key)
            found = [e for e in found if e.key in keys]
        for entry in sorted(found, key=lambda e: e.used):
            self._entries[entry.key] = entry

    def _ours(self, m: dict) -> bool:
        """Whether manifest ``m`` is this engine's: a format it reads, its weights, its rank layout."""
        return m.get("format") in READS and m.get("fingerprint") == self.fingerprint and m.get("layout") == self.layout

    def _mtime(self) -> Optional[int]:
        try:
            return self.dir.stat().st_mtime_ns
        except OSError:
            return None

    def _refresh(self) -> None:
        """Index what the other data-parallel replicas wrote here since this store last looked, and drop what they
        removed (under the lock; nothing is deleted). A file created, renamed or removed in the folder changes its
        mtime, so a lookup costs one ``stat`` while nothing changed (none with one replica: no other writes here).
        This replica's own files are indexed by its writer (and leave the index before they are deleted), so only
        the others' are read here."""
        if self.replicas <= 1:
            return
        stamp = self._mtime()
        if stamp is None or stamp == self._stamp:
            return
        # taken before the listing (a change during it is seen at the next lookup); a stamp under a second old is not
        # kept: a file system's clock ticks coarsely, so a write in the same tick may leave the mtime as it was
        self._stamp = stamp if time.time_ns() - stamp > RACY_NS else None
        try:
            names = [e.name for e in os.scandir(self.dir) if _TMP not in e.name]
        except OSError:
            return
        listed = {n[:-5] for n in names if n.endswith(".json")}
        self._their_pins = set()
        for name in names:
            if name.endswith(_PINS) and name != self._pins_file.name:
                try:
                    self._their_pins.update(k for k in json.loads((self.dir / name).read_text()) if isinstance(k, str))
                except (OSError, ValueError, TypeError):
                    continue  # being replaced (a rename is atomic: gone, not half-written), or not a list
        for key in [k for k, e in self._entries.items() if e.owner != self.replica and k not in listed]:
            del self._entries[key]  # evicted by its replica
        self._passed &= listed
        for key in sorted(listed - self._entries.keys() - self._passed):
            try:
                m = json.loads((self.dir / f"{key}.json").read_text())
                entry = Entry.of(m)
            except FileNotFoundError:  # removed since the listing
                continue
            except (OSError, ValueError, KeyError, TypeError):
                self._passed.add(key)  # a load would refuse it; its owner's store removes it
                continue
            if not self._ours(m) or entry.owner == self.replica or entry.key != key:
                self._passed.add(key)  # foreign (another engine's), or this replica's own (its writer indexes it)
                continue
            self._entries[key] = entry
            self._entries.move_to_end(key)

    def _others(self, peers: set) -> int:
        """The bytes under the root that are not this replica's own contexts (other layouts' folders, other weights'
        or formats' files in its own) -- counted against the bound; said by folder when over half of it."""
        own = {f"{key}{suffix}" for key in self._entries for suffix in (".json", ".safetensors")}
        by_folder: dict[str, int] = {}
        for path in self.root.rglob("*"):
            if not path.is_file() or (path.parent == self.dir and path.name in own):
                continue
            if path.parent != self.dir and path.parent.parent == self.root and path.parent.name in peers:
                continue  # a peer rank's: within its own share
            try:
                size = path.stat().st_size
            except OSError:  # removed meanwhile (another process evicting)
                continue
            where = path.parent.relative_to(self.root).as_posix() if path.parent != self.root else "."
            by_folder[where] = by_folder.get(where, 0) + size
        total = sum(by_folder.values())
        if total > self.bound_bytes // 2:
            listed = ", ".join(f"{self.root / name} ({n / 2**20:.0f} MiB)"
                               for name, n in sorted(by_folder.items(), key=lambda kv: -kv[1]))
            log.warning("context store: %.0f MiB of the %.0f MiB bound (runtime.context_store_mb, --context-store-mb) "
                        "are other layouts' or weights' contexts: %s; this engine keeps what is left. Remove what is "
                        "no longer served, or raise the bound", total / 2**20, self.bound_bytes / 2**20, listed)
        return total

    def __contains__(self, key: str) -> bool:
        with self._lock:
            self._refresh()
            return key in self._entries

    def loads_alone(self, key: str) -> bool:
        """Whether ``key`` is stored: a file loads with the files it continues, whatever else is kept."""
        return key in self

    @property
    def nbytes(self) -> int:
        """The bytes this replica's files count (the others' replicas count theirs)."""
        with self._lock:
            return self._own_bytes()

    def _own_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values() if e.owner == self.replica)

    def longest_prefix(self, context_ids: torch.Tensor, options: str, prefix_of, comes_back=None) -> int:
        """The length of the longest stored proper prefix of ``context_ids`` with these ``options``
        (``prefix_of(n)``: the hex digest of the ids' first ``n`` tokens), or 0. (``comes_back``: as the host
        tier's; every file here loads alone.)"""
        with self._lock:
            self._refresh()
            candidates = [(e.tokens, e.prefix) for e in self._entries.values() if e.options == options]
        return _longest(candidates, int(context_ids.numel()), prefix_of)

    @property
    def _pins_file(self) -> Path:
        return self.dir / f"pinned-r{self.replica}{_PINS}"

    def pin(self, key: str) -> None:
        """Keep ``key`` until :meth:`unpin` -- this replica's own file, and, with several data-parallel replicas,
        another replica's file this one loaded: the pinned keys are written to ``pinned-r<replica>.pins`` beside the
        files, which every replica reads before it evicts."""
        with self._lock:
            self._pinned.add(key)
            self._save_pins()

    def unpin(self, key: str) -> None:
        with self._lock:
            self._pinned.discard(key)
            self._save_pins()

    def _save_pins(self) -> None:
        """This replica's pinned keys to its ``.pins`` file (under the lock; with one replica none is read: none is
        written). A failed write is said and leaves the others free to evict this replica's pins."""
        if self.replicas <= 1:
            return
        tmp = self._pins_file.with_name(self._pins_file.name + _TMP + uuid.uuid4().hex)
        try:
            tmp.write_text(json.dumps(sorted(self._pinned)))
            os.replace(tmp, self._pins_file)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            log.warning("context store: writing %s failed (%s): the other replicas may evict what this one pinned",
                        self._pins_file, e)

    def stats(self) -> dict:
        with self._lock:
            return dict(contexts=len(self._entries), bytes=self._own_bytes(),
                        budget_bytes=self.budget_bytes, bound_bytes=self.bound_bytes, loads=self.loads,
                        writes=self.writes, evictions=self.evictions, refused=self.refused, skipped=self.skipped)

    # -- writing ------------------------------------------------------------------------------------------------
    def save(self, handle, prefix: str, base=None) -> None:
        """Write ``handle`` (this rank's shard) on the background thread; ``prefix``: its ids' prefix digest;
        ``base``: the handle it extended (a conversation's earlier turn), or None. When the store holds ``base`` as
        the writer comes to it (the writes run in order: a turn written just before is), only the KV the handle
        adds is written, its manifest naming ``base`` as its parent: a conversation's turns take the disk of their
        new tokens, not a copy of the whole context each."""
        if handle.shard is None:
            return
        with self._lock:
            if handle.key in self._entries:  # already stored: now the most recent
                self._entries[handle.key].used = time.time()
                self._entries.move_to_end(handle.key)
                return
        link = None
        if base is not None and base.shard is not None and base.key != handle.key:
            link = Link(base.key, base.shard.lengths(), base.nbytes)
        self._queue.put((handle, prefix, link))

    def flush(self, timeout_s: float = 600) -> None:
        """Wait until every write asked for so far is done."""
        done = threading.Event()
        self._queue.put(done)
        if not done.wait(timeout_s):
            raise TimeoutError(f"context store: writes not done after {timeout_s} s")

    def close(self) -> None:
        self._queue.put(None)
        self._writer.join(60)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                self._write(*item)
            except Exception as e:  # a full disk, a removed folder: the context stays in memory; say it once per file
                log.warning("context store: writing %s failed (%s); the context is not stored", item[0].key, e)

    def _write(self, handle, prefix: str, link: Optional[Link] = None) -> None:
        with self._lock:  # room first: the folder never holds more than its bound, even while writing
            self._refresh()  # what the other replicas pinned since the last lookup
            if handle.key in self._entries:  # asked twice before the first write
                return
            parent = None if link is None else self._entries.get(link.key)
            if parent is None or parent.kv != link.kv or parent.owner != self.replica:
                link = None  # not stored (as this handle's first entries), or another replica's: it may evict it
            charge = handle.nbytes - (0 if link is None else min(link.nbytes, handle.nbytes))
            victims = self._make_room(charge, self._free_on_disk(), keep=None if link is None else link.key) \
                if charge <= self.budget_bytes else None
            if victims is None:  # pinned contexts fill the budget, or the disk is near full
                self.skipped += 1
                return
        for key in victims:
            self._delete(key)
        data, manifest = self.dir / f"{handle.key}.safetensors", self.dir / f"{handle.key}.json"
        tmp = [data.with_name(data.name + _TMP + uuid.uuid4().hex),
               manifest.with_name(manifest.name + _TMP + uuid.uuid4().hex)]
        try:
            with _writing(tmp[1]):  # locked before the data is written until the manifest is in place
                self._write_files(handle, prefix, data, manifest, *tmp, link=link, charge=charge)
        except BaseException:
            for path in tmp:  # a full disk, a removed folder: nothing half-written stays
                path.unlink(missing_ok=True)
            raise

    def _free_on_disk(self) -> Optional[int]:
        try:
            return shutil.disk_usage(self.dir).free
        except OSError:
            return None  # the write says what is wrong

    def _write_files(self, handle, prefix: str, data: Path, manifest: Path, tmp: Path, tmp_manifest: Path, *,
                     link: Optional[Link] = None, charge: int) -> None:
        """The data file, then its manifest. With ``link``, each layer's entries after the parent's only (a layer
        with none new has no tensors: its KV is the parent's)."""
        from safetensors.torch import save_file

        tensors = {"context_ids": handle.context_ids.to(torch.int64).contiguous()}
        kv = handle.shard.lengths()
        for i in range(handle.shard.num_layers):  # (a fork's entries after its document's are its own tensors)
            entries = handle.shard.entries(i, 0 if link is None else link.kv[i])
            if entries is None:
                continue
            for name, t in zip(("k", "v", "pos", "mass"), entries):
                if t is not None:
                    tensors[f"{name}.{i}"] = t.detach().cpu().contiguous()
        if handle.last_logits is not None:
            tensors["last_logits"] = handle.last_logits.contiguous()
        save_file(tensors, str(tmp), metadata={"format": str(FORMAT)})
        _fsync(tmp)
        os.replace(tmp, data)
        now = time.time()
        m = {"format": FORMAT, "key": handle.key, "fingerprint": self.fingerprint, "layout": self.layout,
             "options": handle.options, "tokens": handle.context_tokens, "prefix": prefix,
             "nbytes": charge, "held": handle.nbytes, "bytes": data.stat().st_size, "hash": HASH,
             "checksum": _checksum(data), "used": now,
             "query_position": handle.query_position, "method": handle.method, "layers": handle.shard.num_layers,
             "stats": [vars(s) for s in handle.stats], "prefill_stats": handle.prefill_stats, "kv": list(kv),
             "parent": None if link is None else link.key, "parent_kv": None if link is None else list(link.kv),
             "replica": self.replica}
        tmp_manifest.write_text(json.dumps(m, default=str))  # into the locked file (_writing), not a new one
        _fsync(tmp_manifest)
        os.replace(tmp_manifest, manifest)
        with self._lock:
            self._entries[handle.key] = Entry(handle.key, handle.context_tokens, prefix, handle.options, charge, now,
                                              None if link is None else link.key, kv, self.replica)
            self._entries.move_to_end(handle.key)
            self.writes += 1

    def _make_room(self, adding: int, free: Optional[int] = None, keep: Optional[str] = None
                   ) -> Optional[list[str]]:
        """The least recently used unpinned keys to drop so that the budget holds with ``adding`` more bytes --
        taken out of the index, their files for the caller to delete --, or None (nothing dropped) when the pinned
        ones leave too little, or when the disk's ``free`` bytes and those dropped would leave under
        :data:`KEEP_FREE` (said once) (under the lock). Only this replica's files count and go. A context another
        one's file continues (a parent) goes only after its children, and ``keep`` (the parent of the file about to
        be written) and its ancestors stay."""
        total, out, freed = self._own_bytes() + adding, [], 0
        children: dict[str, int] = {}
        for e in self._entries.values():
            if e.parent is not None:
                children[e.parent] = children.get(e.parent, 0) + 1
        if keep is not None:
            children[keep] = children.get(keep, 0) + 1  # the new file's parent: a parent already
        left = OrderedDict(self._entries)
        while total > self.budget_bytes:
            key = next((k for k, e in left.items() if k not in self._pinned and k not in self._their_pins
                        and not children.get(k) and e.owner == self.replica), None)  # this replica's own files only
            if key is None:
                break
            e = left.pop(key)
            total -= e.nbytes
            freed += e.nbytes
            out.append(key)
            if e.parent is not None:
                children[e.parent] -= 1
        if total > self.budget_bytes:
            return None
        if free is not None and free + freed - adding < KEEP_FREE:
            if not self._low_disk_said:
                self._low_disk_said = True
                log.warning("context store: the disk holding %s has %.0f MiB free; contexts are not stored while a "
                            "write would leave under %.0f MiB (free space there, or lower --context-store-mb)",
                            self.dir, free / 2**20, KEEP_FREE / 2**20)
            return None
        for key in out:
            del self._entries[key]
        self.evictions += len(out)
        return out

    def _delete(self, key: str) -> None:
        for suffix in (".json", ".safetensors"):  # the manifest first: a data file without one is never loaded
            (self.dir / f"{key}{suffix}").unlink(missing_ok=True)

    # -- loading ------------------------------------------------------------------------------------------------
    def parent(self, key: str) -> Optional[tuple[str, tuple]]:
        """The stored context whose KV ``key``'s file continues -- its key and this rank's KV entries of it per layer
        (the first entries of ``key``'s shard) --, or None (the file is whole, or ``key`` is not stored)."""
        with self._lock:
            entry = self._entries.get(key)
            up = None if entry is None or entry.parent is None else self._entries.get(entry.parent)
            return None if up is None or up.kv is None else (up.key, up.kv)

    def load(self, key: str, context_ids: Optional[torch.Tensor], device, after: Optional[tuple] = None
             ) -> Optional[dict]:
        """The stored shard of ``key`` -- ``{"shard", "context_ids", "query_position", "stats", "prefill_stats",
        "nbytes", "method", "options", "last_logits"}`` on ``device`` -- or None when it is missing or invalid
        (logged by name; a partial or corrupt file is deleted, with the files that continue it). ``context_ids``: the
        ids it must hold (None: a prefix found by its digest, checked by the caller). A file that continues a
        parent's is read after the parent's, every file of the chain checked: each layer's KV is theirs in order.
        ``after``: the parent's KV entries per layer (:meth:`parent`), held by the caller -- only ``key``'s own file
        is read and checked, and the shard holds the entries after those (None when the file continues another
        version of its parent)."""
        from safetensors import safe_open

        from magnetar.engine.kv import KVShard
        from magnetar.engine.results import RankStats

        if after is None:
            chain = self._chain(key)
        else:
            m = self._manifest(key)
            if m is not None and m.get("parent_kv") != list(after):
                return self._refuse(key, "it continues another version of its parent than the one loaded")
            chain = None if m is None else [(key, m)]
        if chain is None:
            return None
        m = chain[-1][1]
        layers = int(m["layers"])
        pieces: list[list[tuple]] = [[] for _ in range(layers)]
        ids, last = None, None
        for name, _ in chain:
            with safe_open(str(self.dir / f"{name}.safetensors"), framework="pt", device="cpu") as f:
                names = set(f.keys())
                mine = f.get_tensor("context_ids")
                if ids is not None and not torch.equal(mine[: ids.numel()], ids):
                    return self._refuse(key, f"{name} holds other token ids than its parent's (a key collision)")
                ids = mine
                for i in range(layers):
                    if f"k.{i}" in names:
                        pieces[i].append((f.get_tensor(f"k.{i}"), f.get_tensor(f"v.{i}"), f.get_tensor(f"pos.{i}"),
                                          f.get_tensor(f"mass.{i}") if f"mass.{i}" in names else None))
                last = f.get_tensor("last_logits") if "last_logits" in names else None
        if context_ids is not None and not torch.equal(ids, context_ids.reshape(-1).cpu()):
            return self._refuse(key, "it holds other token ids (a key collision)")
        shard = KVShard(layers)
        for layer, parts in zip(shard.layers, pieces):
            if not parts:
                continue
            k, v, pos, mass = zip(*parts)
            mass = None if None in mass else _joined(mass, 2, device)
            layer.append(_joined(k, 2, device), _joined(v, 2, device), _joined(pos, 0, device), mass)
        shard.freeze()
        with self._lock:
            now = time.time()
            for name, _ in chain:
                if name in self._entries:
                    self._entries[name].used = now
                    self._entries.move_to_end(name)
            self.loads += 1
        return {"shard": shard, "context_ids": ids, "query_position": int(m["query_position"]),
                "stats": [RankStats(**s) for s in m["stats"]], "prefill_stats": m.get("prefill_stats"),
                "nbytes": int(m.get("held", m["nbytes"])), "method": m["method"],
                "options": m["options"], "last_logits": last}

    def _chain(self, key: str) -> Optional[list[tuple[str, dict]]]:
        """``[(key, manifest)]`` of ``key`` and the files it continues, the first (whole) one first, each checked
        (:meth:`_manifest`), or None (refused, said in the log)."""
        chain, name = [], key
        while name is not None:
            if any(name == k for k, _ in chain):
                return self._refuse(key, "its parents form a loop", delete=True)
            m = self._manifest(name)
            if m is None:
                return None if name == key else self._refuse(key, f"it continues {name}, which is not loadable",
                                                              delete=True)
            chain.append((name, m))
            name = m.get("parent")
        chain.reverse()
        for (_, parent), (name, child) in zip(chain, chain[1:]):
            if child.get("parent_kv") != parent.get("kv"):
                return self._refuse(key, f"{name} continues another version of its parent", delete=True)
        return chain

    def _manifest(self, key: str) -> Optional[dict]:
        """The manifest of ``key`` when its data file is this engine's, whole and intact, else None (refused)."""
        data, manifest = self.dir / f"{key}.safetensors", self.dir / f"{key}.json"
        try:
            m = json.loads(manifest.read_text())
        except (OSError, ValueError) as e:
            return self._refuse(key, f"its manifest is missing or unreadable ({e})", delete=True)
        if not self._ours(m):
            return self._refuse(key, "it was written by another engine (other weights, layout or format)")
        problem = _data_problem(data, m)
        if problem is not None:
            return self._refuse(key, problem[0], delete=problem[1])
        return m

    def _refuse(self, key: str, why: str, delete: bool = False) -> None:
        with self._lock:
            self.refused += 1
            self._entries.pop(key, None)
            gone = {key}
            while delete:  # the files that continue it can never load either
                more = [k for k, e in self._entries.items() if e.parent in gone]
                if not more:
                    break
                for k in more:
                    del self._entries[k]
                    gone.add(k)
        n = len(gone) - 1
        removed = f"; removed, with the {n} stored context{'s that continue' if n > 1 else ' that continues'} it"
        log.warning("context store: %s is not loaded: %s%s", self.dir / f"{key}.safetensors", why,
                    "" if not delete else removed if n else "; removed")
        if delete:
            for k in gone:
                self._delete(k)
        return None


def describe(root, verify: bool = False) -> dict:
    """What a store folder ``root`` holds, read off its manifests (no model, nothing changed): per rank folder and
    weights fingerprint the contexts, how many are whole and how many continue a parent, the longest chain, the
    largest context, the bytes on disk and the bytes the bound counts, how many each data-parallel replica wrote;
    then every file a store would refuse -- a data file without its manifest, a manifest without its data, a size
    (with ``verify``, a checksum) that differs from its manifest, a file whose parent is not there -- and the pinned
    lists. ``magnetar store DIR`` prints it."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: not a folder (give the --context-store DIR of a server or engine)")
    groups: dict[tuple, dict] = {}
    problems: list[str] = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        manifests = {}
        for path in sorted(folder.glob("*.json")):
            try:
                manifests[path.stem] = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                problems.append(f"{path}: unreadable manifest ({e})")
        writing = _being_written(folder)  # a live writer's files are not problems
        for path in sorted(folder.glob("*.safetensors")):
            if path.stem not in manifests and path.stem not in writing:
                problems.append(f"{path}: no manifest (its writer died; removed when a store opens)")
        for path in sorted(folder.iterdir()):
            if (_TMP in path.name and path.name.split(".")[0] not in writing) or \
                    (path.name.startswith(_LIB_TMP) and not writing):
                problems.append(f"{path}: a write not finished (its writer died; removed when a store opens)")
        for key, m in manifests.items():
            data = folder / f"{key}.safetensors"
            problem = _data_problem(data, m, checksum=verify)
            if problem is not None:
                problems.append(f"{data}: {problem[0]}")
            size = data.stat().st_size if data.exists() else 0
            if m.get("parent") is not None and m["parent"] not in manifests:
                problems.append(f"{data}: continues {m['parent']}, which is not stored (removed when a store opens)")
            g = groups.setdefault((folder.name, str(m.get("fingerprint")), m.get("format")), dict(
                folder=folder.name, fingerprint=str(m.get("fingerprint")), format=m.get("format"), contexts=0,
                whole=0, continuing=0, longest_chain=0, largest_tokens=0, disk_bytes=0, counted_bytes=0,
                by_replica={}))
            g["contexts"] += 1
            writer = str(m.get("replica", 0))  # the data-parallel replica that wrote it (and alone evicts it)
            g["by_replica"][writer] = g["by_replica"].get(writer, 0) + 1
            g["whole" if m.get("parent") is None else "continuing"] += 1
            g["largest_tokens"] = max(g["largest_tokens"], int(m.get("tokens", 0)))
            g["disk_bytes"] += size + (folder / f"{key}.json").stat().st_size
            g["counted_bytes"] += int(m.get("nbytes", 0))
            depth, at, seen = 1, m.get("parent"), {key}
            while at is not None and at in manifests and at not in seen:
                depth, seen, at = depth + 1, seen | {at}, manifests[at].get("parent")
            g["longest_chain"] = max(g["longest_chain"], depth)
    pinned = {}  # the servers' pinned lists (pinned-dp<replica>.json), the stores' pinned keys (<folder>/*.pins)
    for path in _pin_lists(root):
        try:
            pinned[path.relative_to(root).as_posix()] = len(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError) as e:
            problems.append(f"{path}: unreadable pinned list ({e})")
    return dict(root=str(root), groups=list(groups.values()), problems=problems, pinned=pinned,
                disk_bytes=sum(f.stat().st_size for f in root.rglob("*") if f.is_file()))


def _pin_lists(root: Path, replica: str = "*") -> list[Path]:
    """The pinned lists under a store's ``root`` of data-parallel replica ``replica`` (a glob: ``*``, every one's):
    the servers' (``pinned-dp<replica>.json``) and each rank folder's store's (``pinned-r<replica>.pins``)."""
    return sorted(root.glob(f"pinned-dp{replica}.json")) + sorted(root.glob(f"*/pinned-r{replica}{_PINS}"))


def unpin_replica(folder, replica: int) -> list[str]:
    """Remove the pinned lists of data-parallel replica ``replica`` from the context store under ``folder`` -- the
    server's ``pinned-dp<replica>.json`` and each rank folder's ``pinned-r<replica>.pins`` --: what a replica no
    longer run pinned is evictable again (its lists stay otherwise). Returns the files removed (relative to
    ``folder``); a ValueError naming ``--unpin-replica`` when it has none (listing the replicas that have)."""
    root = Path(folder)
    if not root.is_dir():
        raise ValueError(f"{folder}: no such folder (give a store's --context-store DIR)")
    paths = _pin_lists(root, str(replica))
    if not paths:
        have = sorted({int(m.group(1)) for p in _pin_lists(root)
                       if (m := re.fullmatch(rf"pinned-(?:dp|r)(\d+)(?:\.json|{re.escape(_PINS)})", p.name))})
        raise ValueError(f"--unpin-replica {replica}: {folder} holds no pinned list of replica {replica} "
                         f"(replicas with one: {', '.join(map(str, have)) or 'none'})")
    for path in paths:
        path.unlink(missing_ok=True)
    return [path.relative_to(root).as_posix() for path in paths]


def _joined(pieces, dim: int, device) -> torch.Tensor:
    """``pieces`` (a chain's files' tensors, on the host) as one tensor on ``device``, each copied once into place
    (no joined copy on the host first); one piece is moved as it is (a file's memory map, on a CPU)."""
    if len(pieces) == 1:
        return pieces[0].to(device)
    shape = list(pieces[0].shape)
    shape[dim] = sum(p.shape[dim] for p in pieces)
    out = torch.empty(shape, dtype=pieces[0].dtype, device=device)
    at = 0
    for p in pieces:
        out.narrow(dim, at, p.shape[dim]).copy_(p)
        at += p.shape[dim]
    return out


@contextlib.contextmanager
def _writing(tmp_manifest: Path):
    """A context's write lock while the block runs: its manifest's temporary file, created empty (it must not
    exist) and exclusively locked before the data file is written, the manifest later written into it and renamed
    (a lock is the file's, not its name's); released with the descriptor, or by the kernel when the writer dies."""
    fd = os.open(tmp_manifest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _being_written(folder: Path) -> set:
    """The keys a live process is writing in ``folder``: those whose manifest's temporary file is locked
    (:func:`_writing`; a temporary file no one locks is a dead writer's)."""
    keys = set()
    for path in folder.glob(f"*.json{_TMP}*"):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # renamed or removed meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            keys.add(path.name.split(".")[0])
        finally:
            os.close(fd)
    return keys


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


class _HostChain:
    """The host copy of one arena's turns (:class:`~magnetar.engine.kv.KVArena`: a conversation's turns, each a
    prefix of the next): one set of buffers per layer, the longest saved turn's, whose first entries every saved turn
    of the arena views -- counted once, at that turn's ``nbytes`` (the same on every rank)."""

    __slots__ = ("layers", "tokens", "nbytes", "keys", "ids")

    def __init__(self):
        self.layers: list = []  # per layer (k, v, pos) on the host, or None (no entries on this rank)
        self.tokens = self.nbytes = 0  # the longest saved turn's context tokens and bytes
        self.keys: set[str] = set()  # the saved turns that view them
        self.ids: Optional[torch.Tensor] = None  # the longest saved turn's context ids

    def continues(self, ids: torch.Tensor) -> bool:
        """Whether the saved turns and a context of ``ids`` are one conversation (one's ids a prefix of the other's):
        an arena cut down (``KVArena.trim``) may since hold another conversation after the same document."""
        n = min(int(ids.numel()), 0 if self.ids is None else int(self.ids.numel()))
        return self.ids is not None and torch.equal(self.ids[:n], ids.reshape(-1)[:n])

    def leave(self, key: str) -> None:
        """``key`` no longer views the copy (evicted, or loaded back); the last one to leave frees it (the arena, and
        so this chain's entry, may outlive it on the device)."""
        self.keys.discard(key)
        if not self.keys:
            self.layers, self.tokens, self.nbytes, self.ids = [], 0, 0, None


def _host_shard(num_layers: int, skip: Optional[tuple]):
    """An empty frozen host shard: whole, or (``skip``: per layer, the entries of a fork's head it leaves out) a
    fork's own entries alone -- loadable only after a context that holds at least those (``HostTier.load``)."""
    from magnetar.engine.kv import KVShard

    host = KVShard(num_layers)
    host.skip = skip
    host.freeze()
    return host


def _host_copy(shard, skip: Optional[tuple] = None):
    """A host copy of ``shard`` in one segment: its entries from ``skip`` on (None: all of them, a fork's segments
    joined)."""
    host = _host_shard(shard.num_layers, skip)
    for i, mine in enumerate(host.layers):
        entries = shard.entries(i, 0 if skip is None else skip[i])
        if entries is not None:
            mine.append(*(None if t is None else t.cpu() for t in entries))
    return host


def _viewing(shard, chain: _HostChain, skip: Optional[tuple] = None):
    """A frozen host shard of ``shard``'s entry counts (from ``skip`` on) whose layers view the first entries of
    ``chain``'s buffers."""
    out = _host_shard(shard.num_layers, skip)
    for i, (mine, n, buf) in enumerate(zip(out.layers, shard.lengths(), chain.layers)):
        n -= 0 if skip is None else skip[i]
        if n:
            mine.view_first(buf, n)
    return out


def _point(shard, chain: _HostChain) -> None:
    """Make ``shard``'s layers views of the first entries of ``chain``'s buffers (as many as each holds)."""
    for layer, buf in zip(shard.layers, chain.layers):
        if len(layer):
            layer.view_first(buf, len(layer))


class HostTier:
    """The context cache's host-memory tier (``runtime.host_cache_mb``): the contexts the device cache evicts, their
    shards copied to host memory, least recently used out past ``budget_bytes`` (each counted at what a process holds,
    as the cache counts it: the ranks keep and drop alike). A context asked for again is copied back to the device
    and leaves this tier (:meth:`load`) -- the same interface as :class:`ContextStore`, which the encoder asks next.
    On CPU ranks the copy is the tensors themselves where they are whole (a turn, a view of its arena's buffers, is
    copied): the tier then mostly widens the cache.

    A fork keeps its own entries alone (:meth:`save`), and the context they load after is evicted only after them (the
    disk tier's rule for a parent and the files that continue it).

    A conversation's turns (the members of one :class:`~magnetar.engine.kv.KVArena`, each a prefix of the next) share
    one host copy, the longest saved turn's (:class:`_HostChain`): a shorter turn views its first entries, a longer one
    replaces it (the shorter ones then view the new copy), and the tier counts it once and evicts the turns together
    (:meth:`_victims`) -- whether a turn joins a chain is decided on context tokens, the same on every rank."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        # key -> (handle on the host, prefix digest, its chain or None)
        self._items: OrderedDict[str, tuple] = OrderedDict()
        self._chains: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # KVArena -> _HostChain
        self._lock = threading.Lock()
        self.loads = self.writes = self.evictions = self.refused = 0

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._items

    def _bytes(self) -> int:
        """What the tier counts: each context alone, each chain once (under the lock)."""
        chains = {id(c): c.nbytes for _, _, c in self._items.values() if c is not None}
        return sum(h.nbytes for h, _, c in self._items.values() if c is None) + sum(chains.values())

    def save(self, handle, prefix: str) -> None:
        """Keep ``handle`` (one the device cache evicted) with its shard in host memory: a copy, or views of its
        chain's copy when that holds a longer turn of its conversation. A fork (a conversation off a document
        another one extended: :attr:`~magnetar.engine.kv.KVShard.head`) keeps its own entries alone, counted at its
        own tokens' share of its bytes: it loads back after its document (``Encoder._rejoined``), not whole."""
        shard = handle.shard
        if shard is None:
            return
        skip = None
        if shard.head is not None and handle.base is not None and 0 < shard.head_tokens < handle.context_tokens:
            skip = shard.head.lengths()
            own = handle.context_tokens - shard.head_tokens
            handle = dataclasses.replace(handle, nbytes=-(-handle.nbytes * own // handle.context_tokens))
        if handle.nbytes > self.budget_bytes:
            return
        arena = shard.arena
        if arena is not None and any(layer.mass is not None for layer in shard.own):
            arena = None  # (arenas hold no masses; a shard with them is copied alone)
        with self._lock:
            chain = self._chain(arena, handle)
            if chain is not None:  # a shorter turn than one kept: views, no copy
                return self._keep(handle, prefix, _viewing(shard, chain, skip), chain)
        host = _host_copy(shard, skip)  # outside the lock: a device-to-host copy
        with self._lock:
            chain = self._chain(arena, handle)
            if chain is not None:  # a longer turn was kept meanwhile
                host = _viewing(shard, chain, skip)
            elif arena is not None:  # the longest turn so far (or the first): its copy is the chain's
                chain = self._chains.get(arena)
                if chain is None or not chain.keys or not chain.continues(handle.context_ids):
                    chain = self._chains[arena] = _HostChain()  # (another conversation's keeps its own copy)
                chain.layers = [None if layer.k is None else (layer.k, layer.v, layer.pos) for layer in host.layers]
                chain.tokens, chain.nbytes, chain.ids = handle.context_tokens, handle.nbytes, handle.context_ids
                for key in chain.keys:  # the shorter turns kept now view the new copy (the old one is freed)
                    _point(self._items[key][0].shard, chain)
            self._keep(handle, prefix, host, chain)

    def _chain(self, arena, handle) -> Optional[_HostChain]:
        """The chain of ``arena`` when it keeps a longer turn of ``handle``'s conversation (or itself) (under the
        lock)."""
        chain = None if arena is None else self._chains.get(arena)
        return chain if chain is not None and chain.keys and chain.tokens >= handle.context_tokens and \
            chain.continues(handle.context_ids) else None

    def _keep(self, handle, prefix: str, host, chain: Optional[_HostChain]) -> None:
        """Index ``handle`` with its host shard, then drop the least recently used past the budget (under the
        lock)."""
        old = self._items.pop(handle.key, None)
        if old is not None and old[2] is not None:
            old[2].leave(handle.key)
        if chain is not None:
            chain.keys.add(handle.key)
        self._items[handle.key] = (dataclasses.replace(handle, shard=host), prefix, chain)
        self.writes += 1
        while self._items and self._bytes() > self.budget_bytes:
            for key in self._victims():
                _, _, c = self._items.pop(key)
                if c is not None:
                    c.leave(key)
                self.evictions += 1

    def _victims(self) -> list[str]:
        """What to evict next (under the lock): the least recently used context -- a chain's turns together, as
        recent as the last used of them (one alone frees nothing while another views the copy) -- that no fork's own
        entries here load after (they go first: they load only after it); the least recently used otherwise."""
        needed = {h.base[0] for h, _, _ in self._items.values() if h.shard.skip is not None}
        first, seen = None, Counter()
        for key, (_, _, c) in self._items.items():
            unit = [k for k in c.keys if k in self._items] if c is not None and key in c.keys else [key]
            if len(unit) > 1:
                seen[id(c)] += 1
                if seen[id(c)] < len(unit):  # a later turn of the chain was used more recently
                    continue
            if not needed.intersection(unit):
                return unit
            first = first or unit
        return first or [next(iter(self._items))]

    def handles(self) -> list:
        """The contexts kept (handles whose shards are on the host), least recently kept first."""
        with self._lock:
            return [h for h, _, _ in self._items.values()]

    def longest_prefix(self, context_ids: torch.Tensor, options: str, prefix_of, comes_back=None) -> int:
        """As :meth:`ContextStore.longest_prefix`; ``comes_back(key)``: whether a fork's own entries here load (the
        context they load after comes back: :meth:`Encoder.comes_back`) -- one that cannot is no prefix (None: each
        counts)."""
        with self._lock:
            found = [(k, h.context_tokens, p, h.shard.skip is not None) for k, (h, p, _) in self._items.items()
                     if h.options == options]
        candidates = [(n, p) for k, n, p, part in found if not part or comes_back is None or comes_back(k)]
        return _longest(candidates, int(context_ids.numel()), prefix_of)

    def loads_alone(self, key: str) -> bool:
        """Whether ``key`` is here and loads without another context (not a fork's own entries)."""
        with self._lock:
            found = self._items.get(key)
        return found is not None and found[0].shard.skip is None

    def parent(self, key: str) -> Optional[tuple[str, tuple]]:
        """As :meth:`ContextStore.parent`: the context ``key`` extended (its handle's ``base``), or None."""
        with self._lock:
            found = self._items.get(key)
        return None if found is None else found[0].base

    def load(self, key: str, context_ids: Optional[torch.Tensor], device, after: Optional[tuple] = None
             ) -> Optional[dict]:
        """The context of ``key`` on ``device`` (it leaves this tier), as :meth:`ContextStore.load` returns it;
        ``after``: the entries per layer its parent holds (:meth:`parent`) -- the shard holds the ones after them."""
        from magnetar.engine.kv import KVShard

        with self._lock:
            found = self._items.get(key)
            skip = None if found is None else found[0].shard.skip
            if skip is not None and (after is None or any(a < s for a, s in zip(after, skip))):
                return None  # a fork's own entries: loaded only after a context holding its head's (it stays)
            found = self._items.pop(key, None)
            if found is not None and found[2] is not None:
                found[2].leave(key)
        if found is None:
            return None
        h = found[0]
        if context_ids is not None and not torch.equal(h.context_ids, context_ids.reshape(-1).cpu()):
            self.refused += 1
            return None
        shard = KVShard(len(h.shard.layers))
        for i, (mine, theirs) in enumerate(zip(shard.layers, h.shard.layers)):
            cut = (0 if after is None else after[i]) - (0 if skip is None else skip[i])
            if theirs.k is not None and len(theirs) > cut:
                mass = None if theirs.mass is None else theirs.mass[:, :, cut:].to(device)
                mine.append(theirs.k[:, :, cut:].to(device), theirs.v[:, :, cut:].to(device),
                            theirs.pos[cut:].to(device), mass)
        shard.freeze()
        self.loads += 1
        return {"shard": shard, "context_ids": h.context_ids, "query_position": h.query_position, "stats": h.stats,
                "prefill_stats": h.prefill_stats, "nbytes": h.nbytes, "method": h.method, "options": h.options,
                "last_logits": h.last_logits}

    def stats(self) -> dict:
        with self._lock:
            return dict(contexts=len(self._items), bytes=self._bytes(),
                        budget_bytes=self.budget_bytes, loads=self.loads, writes=self.writes,
                        evictions=self.evictions, refused=self.refused)
