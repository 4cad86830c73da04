"""After install-on-device.sh: is what Python loads the kit's, and does it work?

Fails when a package the kit carries (torch, triton, torchvision, vLLM, ...) is imported from
elsewhere, when a CUDA library the kit carries (cuDNN, NCCL) loads from elsewhere, when torch
refuses the cuDNN it loads, or when vLLM does not import. Prints where every CUDA library comes
from and which of vLLM's and torch's requirements the image does not meet (vLLM does not check
them at run time, so they are reported, not fatal). On a GPU it also runs a bf16 matmul and a
convolution and prints vLLM's platform.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

CUDA_LIBRARIES = ("libcudnn", "libnccl", "libcublas", "libcudart", "libnvrtc", "libcusparseLt")


def carried_distributions(manifest: Path) -> dict[str, str]:
    """Distribution name -> version of every wheel in the kit's MANIFEST."""
    carried = {}
    for line in manifest.read_text().splitlines():
        if line.startswith("wheel "):
            name, version = line.split()[1].split("-")[:2]
            carried[canonicalize_name(name)] = version
    return carried


def unmet_requirements(distribution: str) -> tuple[list[str], list[str]]:
    """``distribution``'s requirements that are not installed, and those installed at another version."""
    missing, other_version = [], []
    for text in md.requires(distribution) or []:
        requirement = Requirement(text)
        if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
            continue
        try:
            have = md.version(requirement.name)
        except md.PackageNotFoundError:
            missing.append(requirement.name)
            continue
        if not requirement.specifier.contains(have, prereleases=True):
            other_version.append(f"{requirement} (have {have})")
    return missing, other_version


def _installed(distribution: str) -> bool:
    try:
        md.distribution(distribution)
    except md.PackageNotFoundError:
        return False
    return True


def loaded_libraries() -> dict[str, set[str]]:
    """CUDA library stem -> the files this process mapped for it."""
    loaded: dict[str, set[str]] = {}
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1]
        name = Path(path).name
        for stem in CUDA_LIBRARIES:
            if name.startswith(stem) and re.search(r"\.so(\.|$)", name):
                loaded.setdefault(stem, set()).add(path)
    return loaded


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", type=Path, required=True)
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--require-gpu", action="store_true", help="fail when torch sees no CUDA device")
    args = parser.parse_args()
    target = args.target.resolve()
    problems = []

    carried = carried_distributions(args.manifest)
    for name, version in sorted(carried.items()):
        try:
            distribution = md.distribution(name)
        except md.PackageNotFoundError:
            problems.append(f"{name} {version}: carried but not installed")
            continue
        where = Path(distribution.locate_file("")).resolve()
        if Version(distribution.version) != Version(version) or not where.is_relative_to(target):
            problems.append(f"{name}: Python sees {distribution.version} in {where}, not the kit's {version}")

    problems += [f"{name} is not installed (the image's or the kit's)" for name in ("vllm", "torch")
                 if not _installed(name)]
    if problems:  # what follows would import the image's packages, not the kit's, or fail
        return report(problems)

    for distribution in ("vllm", "torch"):
        missing, other_version = unmet_requirements(distribution)
        if missing:
            print(f"{distribution}: not installed, as the kit leaves them out: {', '.join(missing)}")
        for line in other_version:
            print(f"{distribution} wants {line}")

    import torch

    print("torch", torch.__version__, "from", Path(torch.__file__).parent, "| CUDA", torch.version.cuda,
          "| GPUs", torch.cuda.device_count())
    try:
        print("cuDNN", torch.backends.cudnn.version())
    except RuntimeError as error:  # "cuDNN version incompatibility": every convolution would fail
        problems.append(f"torch refuses its cuDNN: {error}")
    if args.require_gpu and not torch.cuda.is_available():
        problems.append("torch sees no CUDA device on a machine with nvidia-smi (driver too old for this CUDA build?)")
    if torch.cuda.is_available():
        a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close((a @ a.T).float().cpu(), a.float().cpu() @ a.float().cpu().T, atol=1.0, rtol=0.05)
        image = torch.randn(2, 3, 32, 32, device="cuda")
        torch.nn.functional.conv2d(image, torch.randn(8, 3, 3, 3, device="cuda"))
        torch.cuda.synchronize()
        print("bf16 matmul and convolution on", torch.cuda.get_device_name())

    import vllm
    from vllm import LLM, SamplingParams  # noqa: F401  (the engine's import chain)
    from vllm.platforms import current_platform

    capability = current_platform.get_device_capability() if torch.cuda.is_available() else None
    print("vLLM", vllm.__version__, "from", Path(vllm.__file__).parent, "| platform",
          type(current_platform).__name__, capability or "")

    for stem, paths in sorted(loaded_libraries().items()):
        print(f"   {stem}: {', '.join(sorted(paths))}")
        package = {"libcudnn": "nvidia-cudnn-cu13", "libnccl": "nvidia-nccl-cu13"}.get(stem)
        if package in carried and not all(Path(path).is_relative_to(target) for path in paths):
            problems.append(f"{stem} loads from outside the kit ({target})")

    return report(problems)


def report(problems: list[str]) -> int:
    for problem in problems:
        print("PROBLEM:", problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
