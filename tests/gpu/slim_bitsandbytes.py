"""bitsandbytes' wheel with only the native libraries a GPU check needs, to travel in one device call.

    python tests/gpu/slim_bitsandbytes.py .whl/bitsandbytes-0.50.2-*.whl .whl-gpu/ [--cuda 130]

The wheel (43 MB) holds a library per CUDA release (11.8 to 13.2), per ROCm and per XPU release; bitsandbytes
loads the one for torch's CUDA (`torch.version.cuda`: 13.0 -> libbitsandbytes_cuda130.so) and the CPU one. This
writes the same wheel without the other CUDA and ROCm libraries (4 MB), their lines dropped from RECORD.
"""

from __future__ import annotations

import argparse
import re
import zipfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("folder", type=Path, help="where the slimmed wheel goes, under the same name")
    parser.add_argument("--cuda", default="130", help="the CUDA release kept, as in the library's name")
    args = parser.parse_args()
    dropped = re.compile(rf"libbitsandbytes_(rocm\d+|cuda(?!{args.cuda}\.)\d+)\.so")
    args.folder.mkdir(parents=True, exist_ok=True)
    out = args.folder / args.wheel.name
    with zipfile.ZipFile(args.wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
        for info in src.infolist():
            if dropped.search(info.filename):
                continue
            data = src.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = "".join(line + "\n" for line in lines if not dropped.search(line)).encode()
            dst.writestr(info, data)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
