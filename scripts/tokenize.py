#!/usr/bin/env python3
"""Text or JSONL -> token ids for train_gpt, through a Hugging Face model's own
tokenizer (its tokenizer.json, read by the `tokenizers` package from PyPI);
and ids -> text (docs/huggingface.md).

  tokenize.py MODEL_DIR corpus.txt more.jsonl --out train.bin
      writes train.bin (little-endian uint16 ids, or uint32 when the
      vocabulary exceeds 65 536) and train.bin.json {"dtype", "vocab_size",
      "tokens", "documents", "tokenizer"}, which train_gpt reads beside it
      and checks against the model's vocabulary. Documents are separated by
      the end-of-text token (eos_token_id of config.json, else
      tokenizer_config.json's eos_token) unless --no-eos.
  tokenize.py MODEL_DIR --decode 15339,1917
  tokenize.py MODEL_DIR --decode gen.json     (tessera_generate --out)
      prints the text of the ids.

A .jsonl file is one JSON object per line, its text under --key (default
"text"); any other file is one document.
"""
import argparse
import json
import os
import sys


def fail(message):
    sys.exit(f"tokenize.py: error: {message}")


def load_tokenizer(model_dir):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        fail("needs the `tokenizers` package: pip install tokenizers")
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        fail(f"{model_dir} has no tokenizer.json (the fast tokenizer file save_pretrained writes); "
             "convert a slow tokenizer with transformers' AutoTokenizer(...).save_pretrained(DIR) first")
    return Tokenizer.from_file(path)


def eos_id(model_dir, tokenizer):
    config = os.path.join(model_dir, "config.json")
    if os.path.isfile(config):
        eos = json.load(open(config)).get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if isinstance(eos, int):
            return eos
    tconfig = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.isfile(tconfig):
        token = json.load(open(tconfig)).get("eos_token")
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str):
            return tokenizer.token_to_id(token)
    return None


def documents(path, key):
    if path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    fail(f"{path}:{n} is not JSON: {e}")
                if key not in record or not isinstance(record[key], str):
                    fail(f"{path}:{n} has no string under \"{key}\" (choose the field with --key)")
                yield record[key]
    else:
        with open(path, encoding="utf-8") as f:
            yield f.read()


def encode(args):
    import numpy as np
    tokenizer = load_tokenizer(args.model_dir)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    eos = None if args.no_eos else eos_id(args.model_dir, tokenizer)
    ids, docs = [], 0
    for path in args.inputs:
        if not os.path.isfile(path):
            fail(f"{path} does not exist")
        for text in documents(path, args.key):
            ids.extend(tokenizer.encode(text, add_special_tokens=False).ids)
            if eos is not None:
                ids.append(eos)
            docs += 1
    if not ids:
        fail("the inputs hold no tokens")
    dtype = "uint16" if vocab <= 65536 else "uint32"
    array = np.asarray(ids, dtype=np.uint16 if dtype == "uint16" else np.uint32)
    tmp = args.out + ".tmp"
    array.astype(array.dtype.newbyteorder("<")).tofile(tmp)
    os.replace(tmp, args.out)
    meta = {"dtype": dtype, "vocab_size": vocab, "tokens": len(ids), "documents": docs,
            "tokenizer": os.path.abspath(args.model_dir), "eos_token_id": eos}
    with open(args.out + ".json.tmp", "w") as f:
        json.dump(meta, f, indent=2)
    os.replace(args.out + ".json.tmp", args.out + ".json")
    print(f"{args.out}: {len(ids)} tokens ({dtype}) of {docs} documents, vocabulary {vocab}")


def decode(args):
    tokenizer = load_tokenizer(args.model_dir)
    if os.path.isfile(args.decode):
        out = json.load(open(args.decode))
        rows = out.get("tokens", out) if isinstance(out, dict) else out
        rows = rows if rows and isinstance(rows[0], list) else [rows]
    else:
        try:
            rows = [[int(x) for x in args.decode.split(",")]]
        except ValueError:
            fail(f"--decode takes ids separated by commas or a JSON file, got '{args.decode}'")
    for row in rows:
        print(tokenizer.decode(row, skip_special_tokens=False))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", help="a Hugging Face model directory with tokenizer.json")
    parser.add_argument("inputs", nargs="*", help="text files, or .jsonl files")
    parser.add_argument("--out", help="the .bin file to write (its metadata goes to OUT.json)")
    parser.add_argument("--key", default="text", help="the text field of .jsonl records (default text)")
    parser.add_argument("--no-eos", action="store_true", help="no end-of-text token between documents")
    parser.add_argument("--decode", help="ids (comma-separated) or tessera_generate's --out JSON: print their text")
    args = parser.parse_args()
    if args.decode:
        decode(args)
    elif not args.inputs or not args.out:
        fail("give input files and --out FILE.bin (or --decode IDS)")
    else:
        encode(args)


if __name__ == "__main__":
    main()
