"""`python -m nanodspark.check MODEL_DIR`: which config.json fields a load honours, ignores or refuses.

Reads only the checkpoint's `config.json` (and lists its weight files), so it answers at once for
a checkpoint of any size, before any weight is read. The table is `config.check_config`, the
reading `loader.check_checkpoint`; this file is the command line. Exit status 1 if anything is
refused (the load would raise), 0 otherwise.
"""
import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from nanodspark.loader import check_checkpoint
    ap = argparse.ArgumentParser(prog="python -m nanodspark.check", description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", help="a Hugging Face model directory (config.json + safetensors)")
    report = check_checkpoint(ap.parse_args(argv).model_dir)
    print(report.format())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
