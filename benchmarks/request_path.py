"""Which files of magnetar one served chat request runs code in: a one-rank server in this process, one warm-up
request, then a profile hook (``sys.setprofile`` in every thread) records the source file of every Python function
called while ONE chat request -- with a pasted document, so Phase 1 runs -- is answered through the ``openai``
client. A file counts when a function defined in it ran (a file with logic of its own on the request's path);
``__init__`` re-exports and dataclass boilerplate run nothing and do not count. Prints the table, then one JSON line.

    python benchmarks/request_path.py [--model smollm2-135m-instruct]
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "magnetar"
seen: Counter = Counter()
recording = threading.Event()


def _hook(frame, event, arg):
    if event == "call" and recording.is_set():
        name = frame.f_code.co_filename
        if name.startswith(str(ROOT)):
            seen[str(Path(name).relative_to(ROOT.parent))] += 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    args = p.parse_args(argv)
    threading.setprofile(_hook)  # every thread started from now on: uvicorn's, the engine loop's, the tokenizers'
    sys.setprofile(_hook)
    import openai

    import magnetar
    from magnetar.serve.server import Server

    engine = magnetar.init_inference(args.model, method="dense", timeout_s=120)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = Server(engine, model_name="m", port=port, max_tokens=8)
    status = []
    thread = threading.Thread(target=lambda: status.append(server.run()), daemon=True)
    thread.start()
    server.started.wait(120)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    doc = "Magnetar notes.\n\n" + "The quick brown fox jumps over the lazy dog. " * 40 + "\n\nWhat jumps? One word."

    def ask(text: str) -> str:
        return client.chat.completions.create(model="m", max_tokens=8, messages=[{"role": "user", "content": text}],
                                              extra_body={"magnetar": {}}).choices[0].message.content

    ask(doc.replace("fox", "cat"))  # warm-up: lazy imports, op builds, first-call caches
    recording.set()
    answer = ask(doc)
    recording.clear()
    server.drain()
    thread.join(60)
    files = sorted(seen)
    width = max(map(len, files))
    print(f"{'file':<{width}}  calls")
    for f in files:
        print(f"{f:<{width}}  {seen[f]}")
    print(f"\n{len(files)} files of magnetar ran code for one served chat request (answer: {answer!r})")
    print(json.dumps({"bench": "request_path", "files": len(files), "per_file_calls": dict(sorted(seen.items()))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
