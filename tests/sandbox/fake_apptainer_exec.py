"""Stand-in for ``apptainer exec`` on an HPC site (Apptainer is not installable on the CI machines).

It stands for the real binary's option handling and a site's ``apptainer.conf`` policy, nothing more: it
appends its argv as one JSON line to ``$FAKE_APPTAINER_LOG``; with ``$FAKE_APPTAINER_REFUSE`` naming a flag
(e.g. ``--net``) it exits 255 with the error the real binary prints when the site forbids that feature;
otherwise it runs the command after the image on the host, with ``PRORL_EXEC_PYTHON`` set to
``$FAKE_IMAGE_EXEC_PYTHON`` when given (an image built by ``prorl-build-image`` exports it) and unset otherwise.
"""
import json
import os
import sys

args = sys.argv[1:]
if os.environ.get("FAKE_APPTAINER_LOG"):
    with open(os.environ["FAKE_APPTAINER_LOG"], "a") as f:
        f.write(json.dumps(args) + "\n")
if not args or args[0] != "exec":
    sys.exit(f"FATAL: fake apptainer only knows 'exec', got {args[:1]}")
refused = os.environ.get("FAKE_APPTAINER_REFUSE")
if refused and refused in args:
    print(f"FATAL:   container creation failed: {refused}: feature disabled by the system administrator "
          "(apptainer.conf)", file=sys.stderr)
    sys.exit(255)
WITH_VALUE = {"--pwd", "--bind", "-B", "--env", "--network", "--no-mount"}
i = 1
while i < len(args) and args[i].startswith("-"):
    i += 2 if args[i] in WITH_VALUE else 1
if i >= len(args) - 1:
    sys.exit("FATAL: no image or no command")
env = {"PATH": "/usr/bin:/bin"}
if os.environ.get("FAKE_IMAGE_EXEC_PYTHON"):
    env["PRORL_EXEC_PYTHON"] = os.environ["FAKE_IMAGE_EXEC_PYTHON"]
os.execve(args[i + 1], args[i + 1:], env)
