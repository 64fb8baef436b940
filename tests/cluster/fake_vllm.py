"""Stand-in for a vLLM OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``).

Used only to test the launcher's vLLM plumbing (start one per GPU group, wait for ``/health``, register with
``POST /add_llm_server``) on a machine with no GPU; the real vLLM CPU server is exercised by the agent-loop
tests. It takes the same flags the launcher passes (``--model --host --port``, extra ones ignored), answers
``GET /health`` and ``GET /v1/models``, and exits on SIGTERM. With ``--hang-completions`` a
``POST /v1/completions`` never answers (a model that is slow to generate), so a job stays in its run stage.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--hang-completions", action="store_true")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    args, _unknown = p.parse_known_args()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's naming)
            if self.path == "/health":
                body = b""
            elif self.path == "/v1/models":
                body = json.dumps({"object": "list", "data": [{"id": args.model, "object": "model",
                                                               "max_model_len": 4096}]}).encode()
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):  # noqa: N802
            if args.hang_completions and self.path == "/v1/completions":
                stop.wait()
            self.send_error(503)

        def log_message(self, *a):
            pass

    stop = threading.Event()
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True

    def on_term(*_):
        stop.set()
        threading.Thread(target=server.shutdown).start()

    signal.signal(signal.SIGTERM, on_term)
    print(f"fake vLLM serving {args.model} on http://{args.host}:{args.port} "
          f"devices={os.environ.get('CUDA_VISIBLE_DEVICES', 'cpu')} tp={args.tensor_parallel_size}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
