"""Stand-in for ``apptainer build`` / ``singularity build`` (not installable on the CI machines).

Checks what the real builder would refuse (an unknown flag, a missing definition file, a ``%files`` source
that does not exist relative to the working directory), appends one JSON line per call to
``$FAKE_BUILDER_LOG`` (argv and cwd), and writes the image file. With ``$FAKE_BUILDER_FAIL`` set it prints
that text to stderr and exits 255, as the real builder does when it cannot fetch the base image.
"""
import json
import os
import re
import sys
from pathlib import Path

args = sys.argv[1:]
if os.environ.get("FAKE_BUILDER_LOG"):
    with open(os.environ["FAKE_BUILDER_LOG"], "a") as f:
        f.write(json.dumps({"argv": [os.environ.get("FAKE_BUILDER_NAME", Path(sys.argv[0]).name)] + args, "cwd": os.getcwd()}) + "\n")
if not args or args[0] != "build":
    sys.exit(f"FATAL: fake builder only knows 'build', got {args[:1]}")
flags = [a for a in args[1:] if a.startswith("-")]
unknown = [a for a in flags if a not in ("--fakeroot", "--force", "--notest")]
if unknown:
    sys.exit(f"Error: unknown flag: {unknown[0]}")
image, definition = [a for a in args[1:] if not a.startswith("-")]
if os.environ.get("FAKE_BUILDER_FAIL"):
    print(os.environ["FAKE_BUILDER_FAIL"], file=sys.stderr)
    sys.exit(255)
text = Path(definition).read_text()
m = re.search(r"^%files\n(.*?)(?=^%|\Z)", text, re.MULTILINE | re.DOTALL)
for line in (m.group(1).splitlines() if m else []):
    if line.strip():
        src = line.split()[0]
        if not Path(src).exists():
            sys.exit(f"FATAL: While performing build: while copying files: {src}: no such file or directory")
if Path(image).exists() and "--force" not in flags:
    sys.exit(f"FATAL: Build target '{image}' already exists. Use --force if you want to overwrite it")
Path(image).write_bytes(b"FAKE-SIF\n" + text.encode())
print(f"INFO:    Build complete: {image}")
