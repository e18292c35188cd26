"""A newer NCCL for the GPU check, small enough to travel in one device call (docs/testing.md, "A newer NCCL").

    python tests/gpu/slim_nccl.py nvidia_nccl_cu13-2.32.3-*.whl .nccl/nccl-sm90.xz [--arch 90]

The wheel's libnccl.so.2 is 344 MB: device code for eight GPU architectures (75 to 120, and PTX), twice (the
linked fatbins and the relocatable ones), and debug sections. A device call carries 64 MiB with the tree. This
keeps the library byte for byte the same except: every fatbin entry for another architecture has its payload
zeroed (its header kept, so every offset and the entry table stay as they were and the CUDA runtime still finds
the entry for this GPU), and the debug sections are stripped (`strip --strip-debug`). xz then makes it about
34 MB for sm_90 (an H100). On a GPU of another architecture the library would find no kernel for it: make it
with that GPU's `--arch` (compute capability x 10: 80 A100, 90 H100 and H200, 100 B200).

A fatbin (the layout cuobjdump reads; NVIDIA does not document it): a 16-byte header (magic 0xBA55ED50, version,
header size, size of the entries), then entries, each a header (kind, version, header size, payload size, ...,
the architecture at byte 28) and its payload.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import lzma
import shutil
import struct
import subprocess
import tempfile
import zipfile
from pathlib import Path

MAGIC = 0xBA55ED50
SECTIONS = (".nv_fatbin", "__nv_relfatbin")


def sections(path: Path) -> dict[str, tuple[int, int]]:
    """{name: (file offset, size)} of the fatbin sections, from `readelf -S -W`."""
    out = subprocess.run(["readelf", "-S", "-W", str(path)], capture_output=True, text=True, check=True).stdout
    found = {}
    for line in out.splitlines():
        fields = line.replace("[ ", "[").split()
        if len(fields) > 5 and fields[1] in SECTIONS:
            found[fields[1]] = (int(fields[4], 16), int(fields[5], 16))
    return found


def keep_arch(data: bytearray, offset: int, size: int, archs: set[int]) -> tuple[int, int]:
    """Zero the payload of every entry of the fatbins in data[offset:offset + size] whose architecture is not in
    `archs`: (bytes kept, bytes zeroed). A header that points outside its fatbin or makes no progress is an error,
    never a write outside the section."""
    kept = zeroed = 0
    p, end = offset, offset + size
    while p + 16 <= end:
        magic, _, header, body = struct.unpack_from("<IHHQ", data, p)
        if magic != MAGIC:  # padding between fatbins
            p += 8
            continue
        q, stop = p + header, p + header + body
        if header < 16 or stop > end:
            raise ValueError(f"a fatbin at {p:#x} claims {body} bytes past its section's end {end:#x}")
        while q < stop:
            _, _, entry_header, payload = struct.unpack_from("<HHIQ", data, q)
            (arch,) = struct.unpack_from("<I", data, q + 28)
            start = q + entry_header
            if entry_header < 32 or start + payload > stop:
                raise ValueError(f"a fatbin entry at {q:#x} (header {entry_header}, payload {payload}) is malformed")
            if arch in archs:
                kept += payload
            else:
                data[start : start + payload] = bytes(payload)
                zeroed += payload
            q = start + payload
        p = stop
    return kept, zeroed


def version(library: Path) -> int:
    code = ctypes.c_int()
    assert ctypes.CDLL(str(library.resolve())).ncclGetVersion(ctypes.byref(code)) == 0
    return code.value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("output", type=Path, help="the .xz to write: libnccl.so.2, slimmed")
    parser.add_argument("--arch", type=int, action="append", help="compute capability x 10 to keep (default 90)")
    args = parser.parse_args()
    archs = set(args.arch or [90])
    with tempfile.TemporaryDirectory() as tmp:
        original = Path(tmp) / "libnccl.so.2"
        with zipfile.ZipFile(args.wheel) as wheel, open(original, "wb") as out:
            shutil.copyfileobj(wheel.open("nvidia/nccl/lib/libnccl.so.2"), out)
        data = bytearray(original.read_bytes())
        found = sections(original)
        if ".nv_fatbin" not in found:
            raise SystemExit(f"{args.wheel}: its libnccl.so.2 has no .nv_fatbin section (readelf -S): not slimmed")
        for name, (offset, size) in found.items():
            kept, zeroed = keep_arch(data, offset, size, archs)
            print(f"{name}: kept {kept / 1e6:.1f} MB for sm_{sorted(archs)}, zeroed {zeroed / 1e6:.1f} MB")
            if name == ".nv_fatbin" and not kept:  # a wrong --arch would zero every kernel and still load
                raise SystemExit(f"no device code for sm_{sorted(archs)} in {name}: check --arch")
        zeroed_path = Path(tmp) / "zeroed.so"
        zeroed_path.write_bytes(data)
        slim = Path(tmp) / "slim.so"
        subprocess.run(["strip", "--strip-debug", "-o", str(slim), str(zeroed_path)], check=True)
        code = version(original)
        assert version(slim) == code, "the slimmed library reads another version"
        args.output.parent.mkdir(parents=True, exist_ok=True)
        with open(slim, "rb") as src, lzma.open(args.output, "wb", preset=9) as dst:
            shutil.copyfileobj(src, dst, length=1 << 24)
        digest = hashlib.sha256(slim.read_bytes()).hexdigest()
    print(f"wrote {args.output} ({args.output.stat().st_size / 1e6:.1f} MB): NCCL {code}, sha256 {digest}")


if __name__ == "__main__":
    main()
