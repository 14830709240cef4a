"""``magnetar store DIR``: what a context store folder (``--context-store DIR``) holds, read off its manifests --
no model loaded, nothing changed. Per rank folder and weights: the contexts, how many are whole and how many
continue a parent (a conversation's turns, each stored as what it adds), the longest chain, the largest context,
the bytes on disk and what the store's bound counts, how many each data-parallel replica wrote (it alone evicts
them); then every file a store would refuse, and the pinned lists. ``--unpin-replica R`` is the one change it
makes: it removes the pinned lists of data-parallel replica R (one no longer run), so what R pinned is evictable.

    magnetar store /data/contexts
    magnetar store /data/contexts --verify     # also each data file's checksum (reads every byte)
    magnetar store /data/contexts --json       # one JSON line
    magnetar store /data/contexts --unpin-replica 3   # replica 3 is no longer run: free what it pinned
"""
from __future__ import annotations

import json
import sys

from magnetar.utils.cli import ArgumentParser, user_errors

PROG = "magnetar store"


def main(argv=None) -> int:
    p = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="the store's folder (a server's or engine's --context-store DIR)")
    p.add_argument("--verify", action="store_true", help="also check every data file's checksum (reads it all)")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of the tables")
    p.add_argument("--unpin-replica", type=int, default=None, metavar="R",
                   help="remove the pinned lists of data-parallel replica R (a replica no longer run: what it pinned "
                        "stays otherwise); stop R's server first")
    args = p.parse_args(argv)
    if args.unpin_replica is not None and args.unpin_replica < 0:
        p.error(f"--unpin-replica: give a replica index >= 0, got {args.unpin_replica}")
    from magnetar.engine.store import describe, unpin_replica

    if args.unpin_replica is not None:
        with user_errors(PROG):
            removed = unpin_replica(args.folder, args.unpin_replica)
        print(f"removed {', '.join(removed)}: what replica {args.unpin_replica} pinned is evictable again")
        return 0

    with user_errors(PROG):
        found = describe(args.folder, verify=args.verify)
    if args.json:
        print(json.dumps(found))
        return 0
    mib = 2 ** 20
    print(f"context store {found['root']}: {found['disk_bytes'] / mib:.0f} MiB on disk\n")
    if found["groups"]:
        print("| folder | weights | format | contexts | whole / continuing | longest chain | largest context | "
              "on disk | counted | by replica |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
        for g in found["groups"]:
            writers = ", ".join(f"{r}: {n}" for r, n in sorted(g["by_replica"].items(), key=lambda kv: int(kv[0])))
            print(f"| {g['folder']} | {g['fingerprint']} | {g['format']} | {g['contexts']} | {g['whole']} / "
                  f"{g['continuing']} | {g['longest_chain']} | {g['largest_tokens']} tokens | "
                  f"{g['disk_bytes'] / mib:.1f} MiB | {g['counted_bytes'] / mib:.1f} MiB | {writers} |")
    else:
        print("no stored contexts")
    for name, n in found["pinned"].items():
        print(f"\npinned: {name}: {n} context{'s' if n != 1 else ''}")
    if found["problems"]:
        print(f"\n{len(found['problems'])} file(s) a store would not load:", *found["problems"], sep="\n  ")
    else:
        print("\nevery file has its manifest" + (" and checksum" if args.verify else "") +
              (" (sizes checked; --verify reads the checksums)" if not args.verify else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
