use super::*;

#[test]
fn a_uuid_is_read_as_nvidia_smi_or_torch_write_it_and_anything_else_is_named() {
    let smi = ExportingDevice::uuid("GPU-3A4B5C6D-0011-2233-4455-66778899AABB").unwrap();
    let torch = ExportingDevice::uuid("3a4b5c6d-0011-2233-4455-66778899aabb").unwrap();
    let bare = ExportingDevice::uuid("3a4b5c6d00112233445566778899aabb").unwrap();
    assert_eq!(smi, torch);
    assert_eq!(torch, bare);
    assert_eq!(smi.to_string(), "GPU-3a4b5c6d-0011-2233-4455-66778899aabb");
    for bad in
        ["", "GPU-", "3a4b5c6d-0011-2233-4455-66778899aab", "zz4b5c6d00112233445566778899aabb"]
    {
        let e = ExportingDevice::uuid(bad).unwrap_err();
        assert!(e.contains(&format!("`{bad}`")) && e.contains("32 hex digits"), "{e}");
    }
    assert_eq!(ExportingDevice::Ordinal(1).to_string(), "cuda:1");
}

fn span(device: ExportingDevice, handle: u8, offset: u64) -> ExportedSpan {
    ExportedSpan { device, handle: [handle; IPC_HANDLE_BYTES], offset, len: 4 }
}

#[test]
fn spans_of_one_allocation_are_read_together_in_order_of_first_appearance() {
    let a = ExportingDevice::Ordinal(0);
    let b = ExportingDevice::Ordinal(1);
    // Two tensors of one PyTorch block, one of another, one on another device with the
    // same handle bytes (a different allocation).
    let spans =
        [span(a.clone(), 7, 0), span(a.clone(), 9, 0), span(a.clone(), 7, 64), span(b, 7, 0)];
    assert_eq!(by_allocation(&spans), vec![vec![0, 2], vec![1], vec![3]]);
    assert!(by_allocation(&[]).is_empty());
}

#[cfg(not(feature = "cuda"))]
#[test]
fn without_cuda_reading_says_which_feature_is_missing() {
    let e = read_exported(&[span(ExportingDevice::Ordinal(0), 1, 0)]).unwrap_err();
    assert!(matches!(e, Error::NotCompiledWith { feature: "cuda" }), "{e}");
}
