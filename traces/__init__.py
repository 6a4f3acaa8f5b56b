from traces.log import TraceError, TraceWriter, read_trace
from traces.schema import FORMAT_VERSION, AnyEvent, Record

__all__ = ["FORMAT_VERSION", "AnyEvent", "Record", "TraceError", "TraceWriter", "read_trace"]
