"""One wire: no length-prefixed framing and no HMAC handshake outside ``splitlab/wire/``.

Every channel (data lanes, the embedded control bus, RabbitMQ bodies, the ring's control star)
frames with ``wire.header`` and authenticates with ``wire.auth``; a second codec is a bug.

Read from the syntax tree of every module (aliases followed): any ``struct.Struct(...)``, or a
``struct`` pack/unpack of one integer in network order or as a u32 (``struct.pack("!Q", n)``,
``struct.unpack(">I", b)``...) is a length prefix; a call into ``hmac`` (``hmac.new``,
``hmac.compare_digest``, ``hmac.digest``) is a handshake; ``multiprocessing.connection`` or a
``recv_bytes`` call is the stdlib's framed connection.

    pytest tests/unit/test_one_wire.py -q
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "splitlab"
WIRE_DIR = PACKAGE_DIR / "wire"
STRUCT_CALLS = {"Struct", "pack", "pack_into", "unpack", "unpack_from", "iter_unpack", "calcsize"}
HMAC_CALLS = {"new", "compare_digest", "digest", "HMAC"}
PREFIX_FORMAT = re.compile(r"^([>!]\s*[HILQhilq]|[<>!=@]?\s*[IL])$")  # one integer: a length


def _names_from(tree: ast.AST, module: str) -> dict[str, str]:
    """Local name -> imported name, for every `from MODULE import x [as y]`."""
    return {
        alias.asname or alias.name: alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == module and node.level == 0
        for alias in node.names
    }


def _called(node: ast.Call, module: str, local: dict[str, str]) -> str | None:
    """`module.f(...)` -> "f"; `g(...)` with `from module import f as g` -> "f"; else None."""
    func = node.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return func.attr if func.value.id == module else None
    if isinstance(func, ast.Name):
        return local.get(func.id)
    return None


def offences_in(source: str, path: str) -> list[str]:
    """Each length prefix or HMAC call in `source`, as `path:line what`."""
    tree = ast.parse(source, filename=path)
    from_struct, from_hmac = _names_from(tree, "struct"), _names_from(tree, "hmac")
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _called(node, "struct", from_struct)
        if name == "Struct":
            found.append(f"{path}:{node.lineno} length prefix struct.Struct")
        elif name in STRUCT_CALLS and node.args:
            fmt = node.args[0]
            if isinstance(fmt, ast.Constant) and isinstance(fmt.value, str | bytes):
                text = fmt.value.decode() if isinstance(fmt.value, bytes) else fmt.value
                if PREFIX_FORMAT.match(text):
                    found.append(f"{path}:{node.lineno} length prefix struct.{name}({text!r})")
        name = _called(node, "hmac", from_hmac)
        if name in HMAC_CALLS:
            found.append(f"{path}:{node.lineno} handshake hmac.{name}")
        if isinstance(node.func, ast.Attribute) and node.func.attr == "recv_bytes":
            found.append(f"{path}:{node.lineno} framed connection .recv_bytes")
    for node in ast.walk(tree):
        modules = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        if "multiprocessing.connection" in modules:
            found.append(f"{path}:{node.lineno} framed connection multiprocessing.connection")
    return found


def test_detects_prefixes_and_handshakes_but_not_file_headers() -> None:
    source = (
        "import struct, hmac\nfrom struct import Struct as S\nfrom hmac import compare_digest\n"
        "_LEN = struct.Struct('>I')\nb = struct.pack('!Q', 3)\nc = S('>I')\n"
        "d = hmac.new(k, m, 'sha256')\ne = compare_digest(a, b)\n"
        "f = struct.unpack_from('<Q', blob)\ng = struct.pack('<HH', 1, 2)\n"
        "from multiprocessing import connection\nh = conn.recv_bytes()\n"
    )
    assert [line.split(" ", 1)[0] for line in offences_in(source, "x.py")] == [
        "x.py:4", "x.py:5", "x.py:6", "x.py:7", "x.py:8", "x.py:12", "x.py:11",
    ]  # fmt: skip


def test_one_framing_and_one_handshake_outside_wire() -> None:
    found = [
        offence
        for path in sorted(PACKAGE_DIR.rglob("*.py"))
        if WIRE_DIR not in path.parents
        for offence in offences_in(path.read_text(), str(path.relative_to(PACKAGE_DIR.parent)))
    ]
    assert not found, "length prefixes / HMAC handshakes outside splitlab/wire/:\n" + "\n".join(
        found
    )


def test_the_wire_itself_is_seen() -> None:
    """The scan finds the real codec, so an empty result elsewhere means something."""
    found = [
        offence
        for path in sorted(WIRE_DIR.rglob("*.py"))
        for offence in offences_in(path.read_text(), path.name)
    ]
    assert any("length prefix" in f for f in found) and any("handshake" in f for f in found)
