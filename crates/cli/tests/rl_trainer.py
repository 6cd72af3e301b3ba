"""A minimal RL "trainer" for the tests: it perturbs three tensors of a Hugging Face folder and
pushes them to a running `tpctl serve` as an update from memory, in two buckets.

Standard library only (a real trainer would use torch and the safetensors package; the
bytes are the same). Usage:

    rl_trainer.py push  URL BASE_DIR BUCKET_DIR PERTURBED_DIR VERSION
    rl_trainer.py abort URL BASE_DIR BUCKET_DIR

`push` writes the perturbed checkpoint to PERTURBED_DIR too (so the test can compare with a
fresh `tpctl run` on it), sends bucket 1 (two tensors) and bucket 2 (one tensor), deleting
each bucket file as soon as the server took it, and finishes with weight_version VERSION.
`abort` sends bucket 1, then aborts. Prints each reply as a JSON line.
"""

import json
import os
import shutil
import struct
import sys
import urllib.error
import urllib.request

PERTURBED = [
    # (name, how): two in the first bucket, one in the second.
    ("model.layers.0.self_attn.q_proj.weight", 1),
    ("model.layers.1.mlp.down_proj.weight", 1),
    ("model.norm.weight", 2),
]


def read_safetensors(path):
    """Name -> (dtype, shape, bytes) of every tensor of a safetensors file."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        out[name] = (info["dtype"], info["shape"], data[start:end])
    return out


def write_safetensors(path, tensors):
    """Writes name -> (dtype, shape, bytes) as a safetensors file."""
    header, offset, blobs = {}, 0, []
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in blobs:
            f.write(raw)


def perturb(raw, salt):
    """f32 values scaled and shifted by a pattern of their index (a "training step")."""
    values = struct.unpack("<%df" % (len(raw) // 4), raw)
    return struct.pack(
        "<%df" % len(values),
        *(v * 1.5 + 0.05 * (((i * 7 + salt) % 11) - 5) for i, v in enumerate(values)),
    )


def post(url, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="POST")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            reply = json.loads(r.read())
    except urllib.error.HTTPError as e:
        reply = {"status": e.code, "error": json.loads(e.read())}
    print(json.dumps({"path": path.split("?")[0], "reply": reply}), flush=True)
    if "error" in reply:
        sys.exit(1)
    return reply


def main():
    action, url, base, buckets = sys.argv[1:5]
    tensors = read_safetensors(os.path.join(base, "model.safetensors"))
    new = {}
    for salt, (name, _) in enumerate(PERTURBED):
        dtype, shape, raw = tensors[name]
        assert dtype == "F32", dtype
        new[name] = (dtype, shape, perturb(raw, salt))
    paths = []
    for bucket in (1, 2):
        path = os.path.join(buckets, "bucket-%d.safetensors" % bucket)
        write_safetensors(path, {n: new[n] for n, b in PERTURBED if b == bucket})
        paths.append(path)
    if action == "push":
        perturbed, version = sys.argv[5:7]
        shutil.copytree(base, perturbed, dirs_exist_ok=True)
        write_safetensors(os.path.join(perturbed, "model.safetensors"), {**tensors, **new})
        post(url, "/start_weight_update?weight_version=" + version)
        for path in paths:
            post(url, "/update_weights", {"update_info": {"path": path}})
            # The server kept its own reference: the trainer's memory is free at once.
            os.remove(path)
        post(url, "/finish_weight_update?mode=wait")
    elif action == "abort":
        post(url, "/start_weight_update")
        post(url, "/update_weights", {"update_info": {"path": paths[0]}})
        post(url, "/abort_weight_update")
    else:
        sys.exit("unknown action " + action)


if __name__ == "__main__":
    main()
