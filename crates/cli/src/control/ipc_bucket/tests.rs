use super::*;

fn handle(byte: u8) -> String {
    base64::engine::general_purpose::STANDARD.encode([byte; IPC_HANDLE_BYTES])
}

/// A bucket of two tensors in one allocation (handle 1) and one in another (handle 2), on a
/// device named by UUID as PyTorch writes it.
fn bucket() -> IpcBucket {
    let device = DeviceRef::Uuid("3a4b5c6d-0011-2233-4455-66778899aabb".into());
    let at = |h: u8, offset: u64| IpcHandle { device: device.clone(), handle: handle(h), offset };
    IpcBucket {
        names: vec!["a.weight".into(), "b.weight".into(), "c.bias".into()],
        dtype_names: vec!["torch.float32".into(), "bfloat16".into(), "F16".into()],
        shapes: vec![vec![2, 3], vec![4], vec![3]],
        ipc_handles: vec![at(1, 0), at(1, 256), at(2, 8)],
    }
}

/// "Device memory": allocation `h` holds byte `(offset + i) * h` at `offset + i`.
fn fake_read(spans: &[ExportedSpan]) -> vmm::Result<Vec<Vec<u8>>> {
    Ok(spans
        .iter()
        .map(|s| {
            let h = u64::from(s.handle[0]);
            (0..s.len as u64).map(|i| ((s.offset + i) * h) as u8).collect()
        })
        .collect())
}

#[test]
fn a_bucket_of_handles_becomes_a_file_of_the_bytes_behind_them() {
    let dir = std::env::temp_dir().join(format!("tpctl-ipc-bucket-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("b.safetensors");
    let mut asked = Vec::new();
    write_bucket(&bucket(), &path, |spans| {
        asked = spans.to_vec();
        fake_read(spans)
    })
    .unwrap();
    // What was asked of the device: each tensor's bytes at its offset, the device by UUID.
    let lens: Vec<(u64, usize)> = asked.iter().map(|s| (s.offset, s.len)).collect();
    assert_eq!(lens, [(0, 24), (256, 8), (8, 6)]);
    assert!(asked
        .iter()
        .all(|s| s.device.to_string() == "GPU-3a4b5c6d-0011-2233-4455-66778899aabb"));
    // The file: a safetensors header naming each tensor with its dtype and shape, and the
    // bytes as read.
    let file = std::fs::read(&path).unwrap();
    let head = u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&file[8..8 + head]).unwrap();
    let data = &file[8 + head..];
    let expect = [
        ("a.weight", "F32", vec![2, 3]),
        ("b.weight", "BF16", vec![4]),
        ("c.bias", "F16", vec![3]),
    ];
    let read = fake_read(&asked).unwrap();
    for ((name, dtype, shape), bytes) in expect.iter().zip(&read) {
        let e = &header[name];
        assert_eq!(e["dtype"], *dtype, "{name}");
        assert_eq!(e["shape"], serde_json::json!(shape), "{name}");
        let (start, end) =
            (e["data_offsets"][0].as_u64().unwrap(), e["data_offsets"][1].as_u64().unwrap());
        assert_eq!(&data[start as usize..end as usize], bytes.as_slice(), "{name}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_malformed_bucket_is_refused_naming_the_tensor_before_any_device_read() {
    let path = std::env::temp_dir().join(format!("tpctl-ipc-bad-{}", std::process::id()));
    type Spoil = Box<dyn Fn(&mut IpcBucket)>;
    let cases: Vec<(Spoil, &str)> = vec![
        (
            Box::new(|b| b.shapes.pop().map(drop).unwrap_or(())),
            "`shapes` has 2 entries for 3 `names`",
        ),
        (
            Box::new(|b| b.dtype_names[1] = "int8".into()),
            "tensor `b.weight` (entry 1): dtype `int8`",
        ),
        (
            Box::new(|b| b.ipc_handles[2].handle = "not base64!".into()),
            "tensor `c.bias` (entry 2): `handle` is not base64",
        ),
        (
            Box::new(|b| b.ipc_handles[0].handle = handle(1)[..40].to_owned()),
            "`handle` holds 30 bytes",
        ),
        (
            Box::new(|b| b.ipc_handles[0].device = DeviceRef::Uuid("GPU-0".into())),
            "`GPU-0` is not a device UUID",
        ),
        (Box::new(|b| b.names[2] = "a.weight".into()), "tensor `a.weight` (entry 2): named twice"),
        (Box::new(|b| *b = IpcBucket::default()), "names no tensor"),
    ];
    for (spoil, says) in cases {
        let mut b = bucket();
        spoil(&mut b);
        let e =
            write_bucket(&b, &path, |_| panic!("read before the bucket was checked")).unwrap_err();
        assert!(matches!(e, IpcBucketError::Malformed(_)) && e.to_string().contains(says), "{e}");
        assert!(!path.exists());
    }
}

#[test]
fn a_device_that_cannot_be_read_is_named_and_leaves_no_file() {
    let path = std::env::temp_dir().join(format!("tpctl-ipc-unread-{}", std::process::id()));
    let e =
        write_bucket(&bucket(), &path, |_| Err(vmm::Error::NotCompiledWith { feature: "cuda" }))
            .unwrap_err();
    assert!(
        e.to_string().contains("built without CUDA") && e.to_string().contains("`path`"),
        "{e}"
    );
    let e = write_bucket(&bucket(), &path, |_| {
        Err(vmm::Error::Cuda {
            op: "opening the IPC handle".into(),
            code: "CUDA_ERROR_INVALID_VALUE".into(),
        })
    })
    .unwrap_err();
    assert!(
        e.to_string().contains("trainer's GPU") && e.to_string().contains("INVALID_VALUE"),
        "{e}"
    );
    // Fewer bytes than the shape: the writer names the tensor.
    let e = write_bucket(&bucket(), &path, |s| {
        let mut v = fake_read(s)?;
        v[1].pop();
        Ok(v)
    })
    .unwrap_err();
    assert!(e.to_string().contains("b.weight"), "{e}");
    assert!(!path.exists());
}
