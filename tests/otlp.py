"""OTLP trace receivers for tests: spans exported by worker processes land in this process's memory.

Both protocols the exporters speak: ``http/protobuf`` (POST /v1/traces) and ``grpc``
(the collector's TraceService). Each decodes the real export requests.
"""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from orchestrator.local import free_port


@dataclass
class Span:
    name: str
    trace_id: int
    span_id: int
    parent_id: int
    service: str
    attributes: dict[str, Any]
    links: list[int]
    start_ns: int
    end_ns: int
    status_code: int


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


@dataclass
class Received:
    spans: list[Span] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self.lock:
            for rs in request.resource_spans:
                resource = {a.key: _value(a.value) for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append(Span(
                            s.name, int.from_bytes(s.trace_id, "big"), int.from_bytes(s.span_id, "big"),
                            int.from_bytes(s.parent_span_id, "big") if s.parent_span_id else 0,
                            resource.get("service.name", ""), {a.key: _value(a.value) for a in s.attributes},
                            [int.from_bytes(link.span_id, "big") for link in s.links],
                            s.start_time_unix_nano, s.end_time_unix_nano, s.status.code,
                        ))  # fmt: skip

    def of_trace(self, trace_id: int) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]


class HttpReceiver(Received):
    def __init__(self) -> None:
        super().__init__()
        received = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                received.add(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()


class GrpcReceiver(Received):
    def __init__(self) -> None:
        super().__init__()
        import grpc

        received = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                received.add(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        port = free_port()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()
        self.endpoint = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.stop(0)
