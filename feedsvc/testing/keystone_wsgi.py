"""Serve Keystone's public WSGI app on 127.0.0.1 (run by the Keystone venv's
python, never imported by feedsvc): ``keystone_wsgi.py CONFIG_FILE PORT``.

The standard library's WSGI server with a thread per request: enough for
tests and the benchmark's one validation per token.
"""

import os
import socketserver
import sys
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server


class QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


class ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


def main() -> None:
    config, port = sys.argv[1], int(sys.argv[2])
    os.environ["OS_KEYSTONE_CONFIG_FILES"] = config
    del sys.argv[1:]  # oslo.config parses the command line
    from keystone.server.wsgi import initialize_public_application

    app = initialize_public_application()
    server = make_server(
        "127.0.0.1", port, app, server_class=ThreadingServer, handler_class=QuietHandler
    )
    print("ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
