//! Model memory on real vmm allocations: placement, sleep and wakeup, reload.

use super::rank::merge;
use super::*;
use crate::sleep::TagReceipt;
use layers::model::random::RandomLlama;
use layers::parallel::Comms;

/// Greedy tokens of `model` after `prompt`, one decode step at a time.
fn generate(
    model: &ParallelModel,
    cache: &mut ParallelCache,
    first: &[u32],
    steps: usize,
) -> Vec<Vec<f32>> {
    let (mut tp, mut cp) = (collectives::Solo::new("tp"), collectives::Solo::new("cp"));
    let mut comms = Comms { tp: &mut tp, cp: &mut cp };
    let mut tokens = first.to_vec();
    let mut rows = Vec::new();
    for _ in 0..steps {
        let out = model.forward(&mut comms, &tokens, cache, layers::Logits::Last).unwrap();
        let row = out.row(out.rows() - 1).to_vec();
        tokens = vec![crate::argmax(&row)];
        rows.push(row);
    }
    rows
}

/// A model in vmm memory sleeps (weights and KV cache released: the resident memory drops
/// by their size) and wakes with its weights reloaded from the file and its cache backed
/// up: the generation continues bit for bit as if nothing happened.
#[test]
fn a_model_in_vmm_memory_sleeps_and_continues_identically() {
    let dir = std::env::temp_dir().join(format!("tpctl-memory-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tiny.gguf");
    let spec = RandomLlama {
        quantized: Some(tensor::kernels::BlockFormat::Q8_0),
        hidden: 256,
        ffn: 512,
        ..Default::default()
    };
    spec.write(&path).unwrap();
    let placement = Placement::single();
    let form = WeightForm::Native;
    let memory =
        ModelMemory::host(Some(dir.join("spill")), Restore::Reload, Restore::Backup).unwrap();
    let mut model = ParallelModel::load(&path, LoadOptions::new(placement).form(form)).unwrap();
    let heap = model.clone();
    memory
        .place_weights(
            &mut model,
            &ShardOrigin { path: path.clone(), tensors: Vec::new(), placement, form },
        )
        .unwrap();
    let mut cache = memory.new_cache(&model, 64).unwrap();
    let mut heap_cache = heap.new_cache(64);

    let prompt = [1, 2, 3, 4, 5];
    let before = generate(&model, &mut cache, &prompt, 3);
    assert_eq!(before, generate(&heap, &mut heap_cache, &prompt, 3));

    let tags = ["weights", "kv_cache"];
    let released = memory.manager().release(tags).unwrap();
    let weights = released.iter().find(|r| r.tag.as_str() == "weights").unwrap();
    let granularity = memory.manager().granularity();
    assert_eq!(weights.bytes as usize, model.weight_bytes().next_multiple_of(granularity));
    assert_eq!(weights.copied_bytes, 0, "reloaded weights are not backed up");
    memory.manager().materialize(tags).unwrap();

    let next = [crate::argmax(before.last().unwrap())];
    let after = generate(&model, &mut cache, &next, 4);
    assert_eq!(after, generate(&heap, &mut heap_cache, &next, 4));
    assert_eq!(memory.lossy_tags(), Vec::<String>::new());
    std::fs::remove_dir_all(&dir).ok();
}

/// vLLM's levels through the control plane's view: level 1 keeps the weights' contents
/// (copied out at the sleep, back at the wakeup), level 2 reloads them from the file, the
/// KV cache keeps its policy at both, and the generation continues identically; with the
/// weights' policy configured, level 1 keeps that policy.
#[test]
fn sleep_levels_choose_how_the_weights_come_back_and_receipts_say_so() {
    use crate::sleep::RankMemory;
    let dir = std::env::temp_dir().join(format!("tpctl-memory-l-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tiny.gguf");
    RandomLlama { seed: 9, ..Default::default() }.write(&path).unwrap();
    let (placement, form) = (Placement::single(), WeightForm::Native);
    let origin = ShardOrigin { path: path.clone(), tensors: Vec::new(), placement, form };
    for keep in [true, false] {
        let memory = ModelMemory::host(Some(dir.join("spill")), Restore::Reload, Restore::Backup)
            .unwrap()
            .with_level_one_weights(keep);
        let mut model = ParallelModel::load(&path, LoadOptions::new(placement).form(form)).unwrap();
        memory.place_weights(&mut model, &origin).unwrap();
        let mut cache = memory.new_cache(&model, 64).unwrap();
        let heap = ParallelModel::load(&path, LoadOptions::new(placement).form(form)).unwrap();
        let mut heap_cache = heap.new_cache(64);
        let rank = ModelRankMemory::new(&memory, model.backend().clone());
        let mapped = model.weight_bytes().next_multiple_of(memory.manager().granularity());
        let mut next = vec![1, 2, 3];
        for level in [Some(1), Some(2), None] {
            let want = generate(&heap, &mut heap_cache, &next, 2);
            let tags = ["weights".to_owned(), "kv_cache".to_owned()];
            let slept = rank.release_at(&tags, level).unwrap();
            let woke = rank.materialize(&tags).unwrap();
            let kept = keep && level == Some(1);
            let (restore, copied_out) = if kept { ("backup", mapped) } else { ("reload", 0) };
            let what = format!("keep {keep}, level {level:?}");
            assert_eq!(
                (slept[0].restore.as_str(), slept[0].copied_bytes),
                (restore, copied_out as u64),
                "{what}"
            );
            assert_eq!(woke[0].restore, restore, "{what}");
            assert!(woke[0].copied_bytes >= model.weight_bytes() as u64, "{what}");
            assert_eq!(
                (slept[1].restore.as_str(), woke[1].restore.as_str()),
                ("backup", "backup"),
                "{what}"
            );
            let got = generate(&model, &mut cache, &next, 2);
            assert_eq!(got, want, "{what}");
            next = vec![crate::argmax(got.last().unwrap())];
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// The device arena's bookkeeping, over a host manager (addresses are only computed, never
/// read): regions are aligned and packed into the newest allocation, a region that does
/// not fit starts a new chunk (its own size when larger), and a sleep of the tag releases
/// every chunk.
#[test]
fn the_device_arena_packs_regions_into_chunks_of_its_tag() {
    use tensor::DeviceArena;
    let dir = std::env::temp_dir().join(format!("tpctl-memory-d-{}", std::process::id()));
    let manager = Arc::new(vmm::Manager::builder().spill_dir(&dir).build().unwrap());
    let chunk = 1 << 20;
    let arena =
        VmmDeviceArena::new(manager.clone(), vmm::Tag::WEIGHTS, vmm::Policy::Discard, chunk);
    let a = arena.alloc_device(100).unwrap();
    let b = arena.alloc_device(200).unwrap();
    assert_eq!(b.device_ptr(), a.device_ptr() + 128, "packed at the next aligned byte");
    let big = arena.alloc_device(3 << 20).unwrap();
    let c = arena.alloc_device(10).unwrap();
    for r in [&a, &b, &big, &c] {
        assert_eq!(r.device_ptr() % ALIGN as u64, 0);
    }
    assert_eq!((a.size(), big.size(), c.size()), (100, 3 << 20, 10));
    let sizes: Vec<u64> = manager.allocations().iter().map(|i| i.bytes).collect();
    assert_eq!(sizes, [chunk, 3 << 20, chunk].map(|b| b as u64), "a chunk, the big one, a new one");
    let receipts = manager.release(["weights"]).unwrap();
    assert_eq!(receipts[0].allocations, 3);
    manager.materialize(["weights"]).unwrap();
    std::fs::remove_dir_all(&dir).ok();
}

/// Host and device receipts of a tag add up, and device bytes stay counted apart.
#[test]
fn host_and_device_receipts_merge_tag_by_tag() {
    let receipt = |tag: &str, bytes, device_bytes| TagReceipt {
        tag: tag.into(),
        allocations: 1,
        bytes,
        device_bytes,
        copied_bytes: 0,
        elapsed_us: 10,
        restore: String::new(),
    };
    let mut host = vec![receipt("weights", 100, 0), receipt("kv_cache", 50, 0)];
    merge(&mut host, vec![receipt("kv_cache", 400, 400), receipt("weights", 700, 700)]);
    assert_eq!(
        host[0],
        TagReceipt { allocations: 2, elapsed_us: 20, ..receipt("weights", 800, 700) }
    );
    assert_eq!(
        host[1],
        TagReceipt { allocations: 2, elapsed_us: 20, ..receipt("kv_cache", 450, 400) }
    );
}

/// Without a GPU the device manager cannot be made, and says so.
#[test]
fn device_memory_without_a_gpu_is_a_clear_error() {
    if vmm::cuda_driver_present() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("tpctl-memory-g-{}", std::process::id()));
    let m = ModelMemory::host(Some(dir.clone()), Restore::Reload, Restore::Discard).unwrap();
    let err = m.with_device(0).unwrap_err().to_string();
    assert!(err.starts_with("device memory on cuda:0: "), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn the_kv_cache_cannot_be_reloaded_and_discard_is_lossy() {
    let dir = std::env::temp_dir().join(format!("tpctl-memory-p-{}", std::process::id()));
    let err = ModelMemory::host(Some(dir.clone()), Restore::Reload, Restore::Reload);
    assert!(err.unwrap_err().to_string().contains("KV cache cannot be reloaded"));
    let m = ModelMemory::host(Some(dir.clone()), Restore::Backup, Restore::Discard).unwrap();
    assert_eq!(m.lossy_tags(), vec!["kv_cache".to_string()]);
    std::fs::remove_dir_all(&dir).ok();
}
