"""A cuttable TCP relay, used to take PostgreSQL "down" for the processes under test."""

from __future__ import annotations

import asyncio
import threading


class TcpRelay:
    """A TCP relay on 127.0.0.1 between the shipper and PostgreSQL that can be cut (every
    connection aborted, new ones refused) and restored on the same port."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server: asyncio.AbstractServer | None = None
        self.transports: set[asyncio.Transport] = set()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.transport.abort()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self.transports |= {writer.transport, up_writer.transport}
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    def start(self) -> None:
        async def start() -> asyncio.AbstractServer:
            return await asyncio.start_server(self._handle, "127.0.0.1", self.port,
                                              reuse_address=True)

        self.server = asyncio.run_coroutine_threadsafe(start(), self.loop).result(5)
        self.port = self.server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        async def stop() -> None:
            assert self.server is not None
            self.server.close()
            for t in list(self.transports):
                t.abort()
            self.transports.clear()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(5)

    def close(self) -> None:
        self.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
