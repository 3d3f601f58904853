"""`python -m distrib_tf.data prepare`: write a dataset once as ArrayRecord shards.

Usage:

    python -m distrib_tf.data prepare --dataset=SOURCE --out=DIR [--num_shards=8]
        [--data_dir=DIR] [--image_size=256,256] [--test_fraction=0.1]

SOURCE is a registered dataset (`shapes`, `mnist`, ...), `tfrecord:DIR` or `images:DIR`
(`distrib_tf.data.prepare`). Then train with `--dataset=array_record:OUT`. Bad input is
one line naming the file, exit code 2.
"""

import argparse
import sys

import distrib_tf
from distrib_tf import argparsing
from distrib_tf import exit_codes
from distrib_tf.data.prepare import prepare
from distrib_tf.data.registry import DATASETS


def _image_size(text: str) -> tuple[int, int]:
    try:
        height, width = (int(v) for v in text.split(","))
    except ValueError:
        height = width = 0
    if height < 1 or width < 1:
        raise argparse.ArgumentTypeError(f"Received: {text!r}. Expected HEIGHT,WIDTH, e.g. 224,224")
    return height, width


def main(argv=None) -> int:
    distrib_tf.log_to_stderr()
    parser = argparsing.Parser(prog="python -m distrib_tf.data", description="Prepare datasets.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=argparsing.Parser)
    command = commands.add_parser("prepare", help="write a dataset as ArrayRecord shards, read by index")
    command.add_argument("--dataset", required=True, help="a registered dataset (" + ", ".join(DATASETS)
                         + "), tfrecord:DIR or images:DIR")
    command.add_argument("--out", required=True, help="the directory to write the shards and dataset.json to")
    command.add_argument("--format", default="array_record", choices=["array_record"],
                         help="the shards' format")
    command.add_argument("--num_shards", type=int, default=8,
                         help="files per split (tfrecord:DIR: one per input file)")
    command.add_argument("--data_dir", default=None, help="where a TFDS dataset was prepared")
    command.add_argument("--image_size", type=_image_size, default=(256, 256),
                         help="HEIGHT,WIDTH images are resized to when read (tfrecord: and images: sources)")
    command.add_argument("--test_fraction", type=float, default=0.1,
                         help="images:DIR without train/ and test/: the files that make the test split")
    args = parser.parse_args(argv)
    try:
        info = prepare(args.dataset, args.out, num_shards=args.num_shards, data_dir=args.data_dir,
                       image_size=args.image_size, test_fraction=args.test_fraction)
    except (ValueError, OSError) as e:
        print(f"distrib_tf.data: error: {e}", file=sys.stderr)
        return exit_codes.USAGE
    print(f"Wrote {info.num_examples} examples of {args.dataset} to {args.out}; "
          f"train with --dataset={info.name}")
    return exit_codes.OK
