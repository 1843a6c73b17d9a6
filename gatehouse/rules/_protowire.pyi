# The Protobuf walk of protobuf.py in C (_protowire.c): True only when data[start:] reads
# as the message of tables[message]; False: let the Python walk say.
def reads(data: bytes | bytearray | memoryview, start: int, tables: bytes,
          message: int, /) -> bool: ...
