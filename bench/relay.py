"""A TCP relay that puts real latency on the wire between two local processes (benchmarks only).

This machine's kernel has no `netem`, so the delay lives here: every chunk read from one side is
written to the other after the configured one-way delay (plus optional uniform jitter), in
order. Loopback only: it binds 127.0.0.1 and refuses a non-loopback upstream.

    python bench/relay.py --port 60053 --upstream 127.0.0.1:50053 --delay-ms 5 --jitter-ms 1
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import random
import signal
import time


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Relay:
    def __init__(self, upstream_host: str, upstream_port: int, delay_s: float, jitter_s: float = 0.0,
                 seed: int = 0) -> None:
        if not _loopback(upstream_host):
            raise ValueError(f"upstream {upstream_host} is not a loopback address; this relay is for local benchmarks")
        self.upstream = (upstream_host, upstream_port)
        self.delay_s = delay_s
        self.jitter_s = jitter_s
        self.rng = random.Random(seed)

    async def serve(self, port: int) -> asyncio.AbstractServer:
        return await asyncio.start_server(self._connection, "127.0.0.1", port)

    async def _connection(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(self._pump(client_r, up_w), self._pump(up_r, client_w), return_exceptions=True)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read chunks as they come; deliver each `delay` later, never before an earlier one."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
            writer.close()

        sender = asyncio.create_task(deliver())
        last_due = 0.0
        try:
            while data := await reader.read(65536):
                due = max(last_due, time.monotonic() + self.delay_s + self.rng.uniform(0, self.jitter_s))
                last_due = due
                queue.put_nowait((due, data))
        finally:
            queue.put_nowait((last_due, b""))
            await sender


async def _main(args: argparse.Namespace) -> None:
    host, port = args.upstream.rsplit(":", 1)
    relay = Relay(host, int(port), args.delay_ms / 1e3, args.jitter_ms / 1e3, args.seed)
    server = await relay.serve(args.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"relay 127.0.0.1:{server.sockets[0].getsockname()[1]} -> {args.upstream} "
          f"one-way {args.delay_ms} ms ± {args.jitter_ms} ms", flush=True)
    await stop.wait()
    server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True, help="local port to listen on (127.0.0.1)")
    parser.add_argument("--upstream", required=True, help="host:port to forward to (loopback only)")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay added to every chunk")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="extra uniform delay in [0, jitter]")
    parser.add_argument("--seed", type=int, default=0)
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
