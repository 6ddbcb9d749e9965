"""An HTTP/2 (ALPN h2) SSE server on 127.0.0.1 that allows ONE concurrent stream
(SETTINGS_MAX_CONCURRENT_STREAMS=1), answers each POST with a short SSE stream over ~1.5 s, and
prints one JSON line per request with the authorization it got (tests/test_e2e_direct_waits.py)."""
import asyncio
import json
import sys

import h2.config
import h2.connection
import h2.events
import h2.settings

sys.path.insert(0, __import__("os").path.dirname(__file__))
from fake_upstream import self_signed_context

EVENTS = [b'data: {"type":"response.created","response":{"id":"r"}}\n\n',
          b'data: {"type":"response.output_text.delta","delta":"hi"}\n\n',
          b'data: {"type":"response.completed","response":{"id":"r","usage":{"input_tokens":1,"output_tokens":1,"total_tokens":2}}}\n\n']

async def serve(reader, writer):
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
    conn.initiate_connection()
    conn.update_settings({h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 1})
    writer.write(conn.data_to_send())
    heads = {}
    async def answer(sid, head):
        print(json.dumps({"authorization": head.get("authorization")}), flush=True)
        conn.send_headers(sid, [(":status", "200"), ("content-type", "text/event-stream")])
        for i, ev in enumerate(EVENTS):
            conn.send_data(sid, ev, end_stream=i == len(EVENTS) - 1)
            writer.write(conn.data_to_send())
            await asyncio.sleep(0.7)
    while True:
        data = await reader.read(65536)
        if not data:
            break
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.RequestReceived):
                heads[event.stream_id] = dict(event.headers)
            elif isinstance(event, h2.events.DataReceived):
                conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamEnded) and event.stream_id in heads:
                asyncio.ensure_future(answer(event.stream_id, heads.pop(event.stream_id)))
        writer.write(conn.data_to_send())

async def main():
    ctx = self_signed_context()
    ctx.set_alpn_protocols(["h2"])
    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=ctx)
    print(json.dumps({"listening": server.sockets[0].getsockname()[1]}), flush=True)
    await server.serve_forever()

asyncio.run(main())
