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
        .place_weights(&mut model, &ShardOrigin::checkpoint(path.clone(), placement, form))
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
    let origin = ShardOrigin::checkpoint(path.clone(), placement, form);
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

/// The `weights` allocations of `memory`'s manager, by size.
fn weight_allocations(memory: &ModelMemory) -> Vec<u64> {
    let infos = memory.manager().allocations();
    infos.iter().filter(|i| i.tag == vmm::Tag::WEIGHTS).map(|i| i.bytes).collect()
}

/// Weights loaded from an f32 file take an update from the same weights in Q8_0 (other
/// buffers): the PREPARE puts them in a new allocation, the COMMIT swaps it in, the model
/// takes them before its next step and answers as a fresh load of the Q8_0 file, and the old
/// allocation is gone; a level-2 sleep reloads the new file into the new allocation. A revert
/// swaps the f32 weights back the same way; a rollback before the model took the new weights
/// gives it back the buffers it never stopped reading.
#[test]
fn an_update_in_another_form_is_swapped_in_and_reverted() {
    use crate::sleep::RankMemory;
    let dir = std::env::temp_dir().join(format!("tpctl-memory-x-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (f32_path, q8_path) = (dir.join("f32.gguf"), dir.join("q8.gguf"));
    let spec = RandomLlama { seed: 21, untied_head: true, ..Default::default() };
    spec.write(&f32_path).unwrap();
    let q8 = RandomLlama { quantized: Some(tensor::kernels::BlockFormat::Q8_0), ..spec };
    q8.write(&q8_path).unwrap();
    let (placement, form) = (Placement::single(), WeightForm::Native);
    let load = |path: &std::path::Path| {
        ParallelModel::load(path, LoadOptions::new(placement).form(form)).unwrap()
    };
    let answers = |model: &ParallelModel| generate(model, &mut model.new_cache(64), &[1, 2, 3], 4);
    let (want_f32, want_q8) = (answers(&load(&f32_path)), answers(&load(&q8_path)));
    assert_ne!(want_f32, want_q8, "the two forms must answer differently");
    let bytes = |path: &std::path::Path| load(path).weight_bytes() as u64;
    let (f32_bytes, q8_bytes) = (bytes(&f32_path), bytes(&q8_path));

    let memory =
        ModelMemory::host(Some(dir.join("spill")), Restore::Reload, Restore::Backup).unwrap();
    let mut model = load(&f32_path);
    let origin = ShardOrigin::checkpoint(f32_path.clone(), placement, form);
    memory.place_weights(&mut model, &origin).unwrap();
    let rank = ModelRankMemory::new(&memory, model.backend().clone());
    let q8_name = q8_path.to_str().unwrap();

    rank.prepare_update(q8_name).unwrap();
    assert_eq!(weight_allocations(&memory), [f32_bytes, q8_bytes], "both until the swap");
    let receipt = rank.update().unwrap();
    assert_eq!(receipt[0].bytes, q8_bytes);
    assert_eq!(memory.checkpoint(), Some(q8_path.clone()));
    assert_eq!(answers(&model), want_f32, "the model reads its own buffers until it takes them");
    model.adopt_weights(memory.take_new_weights().expect("new weights")).unwrap();
    assert!(memory.take_new_weights().is_none());
    assert_eq!(weight_allocations(&memory), [q8_bytes], "the old buffers are freed");
    assert_eq!(answers(&model), want_q8);
    let tags = ["weights".to_owned()];
    rank.release_at(&tags, Some(2)).unwrap();
    rank.materialize(&tags).unwrap();
    assert_eq!(answers(&model), want_q8, "the wakeup reloads the new file into the new buffers");

    rank.revert().unwrap();
    assert_eq!(memory.checkpoint(), Some(f32_path.clone()));
    model.adopt_weights(memory.take_new_weights().expect("the old weights")).unwrap();
    assert_eq!(weight_allocations(&memory), [f32_bytes]);
    assert_eq!(answers(&model), want_f32);

    // A rollback right after the COMMIT, before the model took the new weights.
    rank.prepare_update(q8_name).unwrap();
    rank.update().unwrap();
    rank.revert().unwrap();
    assert!(memory.take_new_weights().is_none(), "nothing left to take");
    assert_eq!(weight_allocations(&memory), [f32_bytes]);
    assert_eq!(memory.checkpoint(), Some(f32_path.clone()));
    assert_eq!(answers(&model), want_f32);
    std::fs::remove_dir_all(&dir).ok();
}

/// An update that cannot be taken is refused before anything changes, in the model's terms:
/// another shape names the field, weights in another form are refused while asleep and when
/// the host lacks the memory for their new buffers (with the numbers); nothing is staged.
#[test]
fn updates_that_do_not_fit_are_refused_by_name_before_any_change() {
    use crate::sleep::RankMemory;
    let dir = std::env::temp_dir().join(format!("tpctl-memory-r-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let spec = RandomLlama { seed: 22, ..Default::default() };
    let write = |name: &str, spec: RandomLlama| {
        let path = dir.join(name);
        spec.write(&path).unwrap();
        path.to_str().unwrap().to_owned()
    };
    let live = write("live.gguf", spec.clone());
    let wider = write("wider.gguf", RandomLlama { ffn: 128, layers: 3, ..spec.clone() });
    let q8 = RandomLlama { quantized: Some(tensor::kernels::BlockFormat::Q8_0), ..spec.clone() };
    let q8 = write("q8.gguf", q8);
    let (placement, form) = (Placement::single(), WeightForm::Native);
    let memory =
        ModelMemory::host(Some(dir.join("spill")), Restore::Reload, Restore::Backup).unwrap();
    let memory = ModelMemory { host_available: || Some(1000), ..memory };
    let mut model = ParallelModel::load(&live, LoadOptions::new(placement).form(form)).unwrap();
    let origin = ShardOrigin::checkpoint(live.clone(), placement, form);
    memory.place_weights(&mut model, &origin).unwrap();
    let rank = ModelRankMemory::new(&memory, model.backend().clone());
    let before = weight_allocations(&memory);

    let err = rank.prepare_update(&wider).unwrap_err().to_string();
    assert_eq!(
        err,
        format!(
            "{wider} does not fit the live weights: 3 layers; the live model has 2; \
             feed-forward size 128; the live model has 96"
        )
    );
    let err = rank.prepare_update(&q8).unwrap_err().to_string();
    let needed = ParallelModel::load(&q8, LoadOptions::new(placement).form(form))
        .unwrap()
        .weight_bytes()
        .next_multiple_of(memory.manager().granularity());
    assert!(err.starts_with(&format!("{q8} stores the weights in another form")), "{err}");
    assert!(err.contains(&format!("needs {needed} bytes")), "{err}");
    assert!(err.ends_with("and 1000 bytes (0 MiB) are available"), "{err}");
    assert_eq!(weight_allocations(&memory), before);

    let tags = ["weights".to_owned()];
    rank.release_at(&tags, Some(2)).unwrap();
    let err = rank.prepare_update(&q8).unwrap_err().to_string();
    assert_eq!(
        err,
        format!(
            "{q8} stores the weights in another form than the live ones, and those are \
             asleep: wake them up first, then reload"
        )
    );
    let err = rank.update().unwrap_err();
    assert_eq!(err.message, "no weight update is staged");
    rank.materialize(&tags).unwrap();
    assert_eq!(memory.checkpoint(), Some(live.into()));
    std::fs::remove_dir_all(&dir).ok();
}

/// A Hugging Face folder of the weights a Q8_0 GGUF file holds (f32 safetensors) replaces
/// them: swapped in, the model answers as a fresh load of the folder.
#[test]
fn an_update_from_a_hugging_face_folder_of_a_gguf_model_is_swapped_in() {
    use crate::sleep::RankMemory;
    let dir = std::env::temp_dir().join(format!("tpctl-memory-hf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (gguf, folder) = (dir.join("q8.gguf"), dir.join("hf"));
    let spec = RandomLlama { seed: 23, ..Default::default() };
    spec.write_hf(&folder, false).unwrap();
    RandomLlama { quantized: Some(tensor::kernels::BlockFormat::Q8_0), ..spec }
        .write(&gguf)
        .unwrap();
    let (placement, form) = (Placement::single(), WeightForm::Native);
    let load = |path: &std::path::Path| {
        ParallelModel::load(path, LoadOptions::new(placement).form(form)).unwrap()
    };
    let answers = |model: &ParallelModel| generate(model, &mut model.new_cache(64), &[4, 5], 4);
    let memory =
        ModelMemory::host(Some(dir.join("spill")), Restore::Reload, Restore::Backup).unwrap();
    let mut model = load(&gguf);
    memory
        .place_weights(&mut model, &ShardOrigin::checkpoint(gguf.clone(), placement, form))
        .unwrap();
    let rank = ModelRankMemory::new(&memory, model.backend().clone());
    rank.prepare_update(folder.to_str().unwrap()).unwrap();
    rank.update().unwrap();
    model.adopt_weights(memory.take_new_weights().expect("new buffers")).unwrap();
    assert_eq!(answers(&model), answers(&load(&folder)));
    assert_eq!(memory.checkpoint(), Some(folder));
    std::fs::remove_dir_all(&dir).ok();
}

/// Writes the Hugging Face tensor `hf_name` (as GGUF name `name` of the folder `folder`)
/// negated into a bucket of its own at `out`.
fn one_tensor_bucket(folder: &std::path::Path, name: &str, hf_name: &str, out: &std::path::Path) {
    use checkpoint::WeightSource;
    let hf = checkpoint::safetensors::HfCheckpoint::open(folder).unwrap();
    let shape = hf.shape(name).unwrap();
    let values: Vec<f32> = hf.rows(name, 0..shape[0]).unwrap().iter().map(|v| -v).collect();
    let st = checkpoint::safetensors::StDType::F32;
    checkpoint::safetensors::write_safetensors(out, &[(hf_name, &shape[..], st, &values[..])])
        .unwrap();
}

/// Buckets laid over the live f32 weights' own checkpoint are written in place: the receipt
/// counts only the bytes of the tensors they hold (not the whole weights), no allocation is
/// added, and the model answers as a fresh load of the checkpoint with the buckets over it,
/// bucket after bucket (a query projection included, whose rows the GGUF file interleaves).
/// A level-2 sleep reloads the same weights, a revert brings back the previous ones, and
/// weights kept quantized take the same bucket through a load into new buffers instead.
#[test]
fn buckets_over_the_live_checkpoint_are_written_in_place() {
    use crate::sleep::RankMemory;
    let dir = std::env::temp_dir().join(format!("tpctl-memory-in-place-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (gguf, folder) = (dir.join("base.gguf"), dir.join("hf"));
    let spec = RandomLlama { seed: 27, untied_head: true, ..Default::default() };
    spec.write(&gguf).unwrap();
    RandomLlama { seed: 28, ..spec.clone() }.write_hf(&folder, false).unwrap();
    let (down, q) = (dir.join("down.safetensors"), dir.join("q.safetensors"));
    one_tensor_bucket(
        &folder,
        "blk.0.ffn_down.weight",
        "model.layers.0.mlp.down_proj.weight",
        &down,
    );
    one_tensor_bucket(&folder, "blk.1.attn_q.weight", "model.layers.1.self_attn.q_proj.weight", &q);

    let (placement, form) = (Placement::single(), WeightForm::F32);
    let origin = |tensors: &[&std::path::Path]| ShardOrigin {
        tensors: tensors.iter().map(|p| p.to_path_buf()).collect(),
        ..ShardOrigin::checkpoint(gguf.clone(), placement, form)
    };
    let answers = |model: &ParallelModel| generate(model, &mut model.new_cache(64), &[4, 5], 4);
    let memory = ModelMemory::host(Some(dir.join("spill")), Restore::Reload, Restore::Backup)
        .unwrap()
        .with_threads(3);
    let mut model = origin(&[]).load().unwrap();
    let all_bytes = model.weight_bytes() as u64;
    memory.place_weights(&mut model, &origin(&[])).unwrap();
    let want_base = answers(&model);
    let rank = ModelRankMemory::new(&memory, model.backend().clone());
    let name = gguf.to_str().unwrap();
    let paths = |ps: &[&std::path::Path]| -> Vec<String> {
        ps.iter().map(|p| p.to_str().unwrap().to_owned()).collect()
    };

    // Bytes written under live addresses are announced, so a GPU's copies of them go stale
    // (other tests may bump the generation too: only an increase is certain).
    let generation = tensor::memory::weights_generation;
    let before = generation();
    memory.prepare_update_with(name, &paths(&[&down])).unwrap();
    let receipt = rank.update().unwrap();
    assert!(generation() > before, "an update in place bumps the weights generation");
    let (hidden, ffn) = (spec.hidden as u64, spec.ffn as u64);
    assert_eq!(receipt[0].bytes, 4 * hidden * ffn, "only the down projection is written");
    assert_eq!(weight_allocations(&memory).len(), 1, "no new allocation");
    assert!(memory.take_new_weights().is_none());
    let want_down = answers(&origin(&[&down]).load().unwrap());
    assert_ne!(want_down, want_base);
    assert_eq!(answers(&model), want_down);

    memory.prepare_update_with(name, &paths(&[&down, &q])).unwrap();
    let receipt = rank.update().unwrap();
    assert_eq!(receipt[0].bytes, 4 * hidden * hidden, "only the query projection is written");
    let want_both = answers(&origin(&[&down, &q]).load().unwrap());
    assert_ne!(want_both, want_down);
    assert_eq!(answers(&model), want_both);
    let tags = ["weights".to_owned()];
    rank.release_at(&tags, Some(2)).unwrap();
    let before = generation();
    rank.materialize(&tags).unwrap();
    assert!(generation() > before, "restoring the weights bumps the weights generation");
    assert_eq!(answers(&model), want_both, "the wakeup reloads the checkpoint and both buckets");
    rank.revert().unwrap();
    assert_eq!(answers(&model), want_down);

    // A checkpoint reload is a load, of every byte.
    memory.prepare_update(name).unwrap();
    assert_eq!(rank.update().unwrap()[0].bytes, all_bytes);
    assert_eq!(answers(&model), want_base);

    // Quantized weights cannot take floats in place: the bucket's shard is loaded whole.
    let quantized = dir.join("q8.gguf");
    RandomLlama { quantized: Some(tensor::kernels::BlockFormat::Q8_0), ..spec }
        .write(&quantized)
        .unwrap();
    let memory =
        ModelMemory::host(Some(dir.join("spill-q8")), Restore::Reload, Restore::Backup).unwrap();
    let q8 = ShardOrigin::checkpoint(quantized.clone(), placement, WeightForm::Native);
    let mut model = q8.load().unwrap();
    memory.place_weights(&mut model, &q8).unwrap();
    memory.prepare_update_with(quantized.to_str().unwrap(), &paths(&[&down])).unwrap();
    memory.update().unwrap();
    model.adopt_weights(memory.take_new_weights().expect("new buffers")).unwrap();
    let want = ShardOrigin { tensors: vec![down.clone()], ..q8 }.load().unwrap();
    assert_eq!(answers(&model), answers(&want));
    std::fs::remove_dir_all(&dir).ok();
}

/// An update that lands while the weights sleep at level 1 (their bytes backed up) is what the
/// wakeup brings back, not the backup of the weights it replaced.
#[test]
fn an_update_while_asleep_at_level_one_wakes_with_the_new_weights() {
    use crate::sleep::RankMemory;
    let dir = std::env::temp_dir().join(format!("tpctl-memory-l1-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (gguf, folder) = (dir.join("base.gguf"), dir.join("hf"));
    let spec = RandomLlama { seed: 29, ..Default::default() };
    spec.write(&gguf).unwrap();
    RandomLlama { seed: 30, ..spec.clone() }.write_hf(&folder, false).unwrap();
    let down = dir.join("down.safetensors");
    one_tensor_bucket(
        &folder,
        "blk.0.ffn_down.weight",
        "model.layers.0.mlp.down_proj.weight",
        &down,
    );
    let (placement, form) = (Placement::single(), WeightForm::F32);
    let base = ShardOrigin::checkpoint(gguf.clone(), placement, form);
    let updated = ShardOrigin { tensors: vec![down.clone()], ..base.clone() };
    let answers = |model: &ParallelModel| generate(model, &mut model.new_cache(64), &[4, 5], 4);
    let want = answers(&updated.load().unwrap());
    let memory = ModelMemory::host(Some(dir.join("spill")), Restore::Reload, Restore::Backup)
        .unwrap()
        .with_level_one_weights(true);
    let mut model = base.load().unwrap();
    memory.place_weights(&mut model, &base).unwrap();
    assert_ne!(answers(&model), want);
    let rank = ModelRankMemory::new(&memory, model.backend().clone());
    let tags = ["weights".to_owned()];
    rank.release_at(&tags, Some(1)).unwrap();
    memory
        .prepare_update_with(gguf.to_str().unwrap(), &[down.to_str().unwrap().to_owned()])
        .unwrap();
    rank.update().unwrap();
    let receipts = rank.materialize(&tags).unwrap();
    assert_eq!(answers(&model), want, "the wakeup restored the replaced weights");
    assert_eq!(receipts[0].restore, "reload", "{receipts:?}");
    std::fs::remove_dir_all(&dir).ok();
}

/// A wakeup that brings the weights back runs the registered device preparation before it
/// returns its receipts, in the weights' time, and so does an update written over the live
/// buffers; a wakeup of the KV cache alone does not run it; a failing one leaves the wakeup
/// done (the first use then makes the copies).
#[test]
fn a_wakeup_of_the_weights_makes_the_device_copies_before_its_receipt() {
    use crate::sleep::RankMemory;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let dir = std::env::temp_dir().join(format!("tpctl-memory-prep-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tiny.gguf");
    RandomLlama { seed: 10, ..Default::default() }.write(&path).unwrap();
    let (placement, form) = (Placement::single(), WeightForm::Native);
    let origin = ShardOrigin::checkpoint(path.clone(), placement, form);
    let memory =
        ModelMemory::host(Some(dir.join("spill")), Restore::Reload, Restore::Backup).unwrap();
    let mut model = ParallelModel::load(&path, LoadOptions::new(placement).form(form)).unwrap();
    memory.place_weights(&mut model, &origin).unwrap();
    let _cache = memory.new_cache(&model, 64).unwrap();
    let rank = ModelRankMemory::new(&memory, model.backend().clone());
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let pause = std::time::Duration::from_millis(30);
    memory.set_device_preparation(Some(Arc::new(move || {
        counted.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(pause);
        Ok(())
    })));
    let tags = |t: &[&str]| t.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();

    rank.release(&tags(&["kv_cache"])).unwrap();
    rank.materialize(&tags(&["kv_cache"])).unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 0, "a KV-cache wakeup prepared the weights");

    rank.release(&tags(&["weights", "kv_cache"])).unwrap();
    let woke = rank.materialize(&tags(&["weights", "kv_cache"])).unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the weights' wakeup did not prepare them");
    assert_eq!(woke[0].tag, "weights");
    assert!(woke[0].elapsed_us >= pause.as_micros() as u64, "{:?}", woke[0]);

    // An update written over the live buffers makes them again too (a reload of the file).
    rank.prepare_update(path.to_str().unwrap()).unwrap();
    let updated = rank.update().unwrap();
    assert!(updated[0].copied_bytes > 0);
    assert_eq!(runs.load(Ordering::SeqCst), 2, "the update did not prepare the weights");

    memory.set_device_preparation(Some(Arc::new(|| Err("the device is gone".into()))));
    rank.release(&tags(&["weights"])).unwrap();
    let woke = rank.materialize(&tags(&["weights"])).unwrap();
    assert_eq!(woke[0].restore, "reload");
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    std::fs::remove_dir_all(&dir).ok();
}

/// Greedy ids of `model` continuing `prompt` for `steps` batched decode steps (through the
/// backend's planned steps), on a cache from `memory`.
fn batched_ids(
    model: &ParallelModel,
    memory: &ModelMemory,
    prompt: &[u32],
    steps: usize,
) -> Vec<u32> {
    let (mut tp, mut cp) = (collectives::Solo::new("tp"), collectives::Solo::new("cp"));
    let mut comms = Comms { tp: &mut tp, cp: &mut cp };
    let mut cache = memory.new_cache(model, 64).unwrap();
    let mut tokens = prompt.to_vec();
    let mut ids = Vec::new();
    for _ in 0..steps {
        let mut seqs = [layers::parallel::Sequence::sampled(&tokens, &mut cache)];
        let id = model.forward_batch_argmax(&mut comms, &mut seqs).unwrap().unwrap()[0];
        ids.push(id);
        tokens = vec![id];
    }
    ids
}

/// What the runtime holds sleeps under tags of its own (`cuda_graph`, `workspace`), asked in
/// any order beside the tagged memory: where the backend holds none of it (the plain CPU) each
/// is reported `none` with nothing released; on a backend that plans its step buffers, a sleep
/// of `workspace` gives back every plan's bytes (the workspaces the stats counted) and the
/// steps after the wakeup plan again, with the same tokens.
#[test]
fn runtime_tags_release_the_step_workspaces_and_say_none_where_nothing_is_held() {
    use super::runtime::{CUDA_GRAPH, NOTHING_HELD, WORKSPACE};
    use crate::sleep::RankMemory;
    let dir = std::env::temp_dir().join(format!("tpctl-memory-rt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tiny.gguf");
    RandomLlama { seed: 12, ..Default::default() }.write(&path).unwrap();
    let (placement, form) = (Placement::single(), WeightForm::F32);
    let origin = ShardOrigin::checkpoint(path.clone(), placement, form);
    let tags: Vec<String> =
        [WORKSPACE, "weights", CUDA_GRAPH, "kv_cache"].map(str::to_owned).to_vec();
    for planned in [false, true] {
        let be = if planned {
            tensor::test_util::cpu_with_planned_device_outputs(1)
        } else {
            Backend::cpu(1).unwrap()
        };
        let memory =
            ModelMemory::host(Some(dir.join("spill")), Restore::Reload, Restore::Discard).unwrap();
        let opts = LoadOptions::new(placement).on(be.clone()).form(form);
        let mut model = ParallelModel::load(&path, opts).unwrap();
        memory.place_weights(&mut model, &origin).unwrap();
        let rank = ModelRankMemory::new(&memory, be.clone());
        let prompt = [3, 1, 4, 1, 5];
        let before = batched_ids(&model, &memory, &prompt, 4);
        let planned_bytes = be.workspace_stats().map_or(0, |s| s.planned_bytes as u64);
        assert_eq!(planned, planned_bytes > 0, "planned {planned}: {:?}", be.workspace_stats());

        rank.check(&tags).unwrap();
        let slept = rank.release(&tags).unwrap();
        let order: Vec<&str> = slept.iter().map(|r| r.tag.as_str()).collect();
        assert_eq!(order, tags.iter().map(String::as_str).collect::<Vec<_>>(), "as asked");
        let (workspace, graphs) = (&slept[0], &slept[2]);
        assert_eq!(
            (graphs.restore.as_str(), graphs.bytes),
            (NOTHING_HELD, 0),
            "the CPU has no graphs"
        );
        if planned {
            assert_eq!(workspace.restore, "replan");
            assert_eq!(workspace.bytes, planned_bytes, "every plan's workspace");
            assert!(workspace.allocations >= 1, "{workspace:?}");
            assert_eq!(be.workspace_stats().unwrap().planned_bytes, 0, "the plans are gone");
        } else {
            assert_eq!((workspace.restore.as_str(), workspace.bytes), (NOTHING_HELD, 0));
        }
        assert_eq!((slept[1].restore.as_str(), slept[3].restore.as_str()), ("reload", "discard"));
        assert!(slept[1].bytes > 0, "the weights are released beside them");

        let woke = rank.materialize(&tags).unwrap();
        let restores: Vec<&str> = woke.iter().map(|r| r.restore.as_str()).collect();
        let runtime = if planned { "replan" } else { NOTHING_HELD };
        assert_eq!(restores, [runtime, "reload", NOTHING_HELD, "discard"], "planned {planned}");
        let made = be.workspace_stats().map(|s| s.workspaces);
        assert_eq!(batched_ids(&model, &memory, &prompt, 4), before, "planned {planned}");
        if planned {
            assert!(be.workspace_stats().unwrap().workspaces > made.unwrap(), "planned again");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A group's device resources that record what was done to them, and fail when told to.
#[derive(Debug)]
struct FakeComm {
    group: &'static str,
    released: std::sync::atomic::AtomicBool,
    refuse_release: bool,
}

impl FakeComm {
    fn new(group: &'static str, refuse_release: bool) -> Arc<FakeComm> {
        Arc::new(FakeComm { group, released: Default::default(), refuse_release })
    }
}

impl collectives::DeviceResources for FakeComm {
    fn group(&self) -> &str {
        self.group
    }
    fn release(&self) -> collectives::Result<()> {
        if self.refuse_release {
            let at = collectives::Site {
                op: collectives::Op::Setup,
                group: self.group.into(),
                rank: 0,
                size: 2,
            };
            return Err(collectives::Error::Released { at });
        }
        self.released.store(true, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }
    fn restore(&self) -> collectives::Result<()> {
        self.released.store(false, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }
    fn is_released(&self) -> bool {
        self.released.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// The `nccl` tag releases every group's device resources and the wakeup restores them, one
/// receipt counting the groups; a rank without any says `none`; a group that cannot release
/// fails the sleep naming it, saying whether an earlier group was released already (the undo
/// then restores it).
#[test]
fn the_nccl_tag_releases_and_restores_every_groups_communicator() {
    use super::runtime::{NCCL, NOTHING_HELD};
    use crate::sleep::RankMemory;
    use collectives::DeviceResources;
    let memory = ModelMemory::host(None, Restore::Reload, Restore::Discard).unwrap();
    let be = Backend::cpu(1).unwrap();
    let tags = vec![NCCL.to_owned()];

    let none = ModelRankMemory::new(&memory, be.clone());
    let r = none.release(&tags).unwrap();
    assert_eq!((r[0].restore.as_str(), r[0].allocations), (NOTHING_HELD, 0));
    assert_eq!(none.materialize(&tags).unwrap()[0].restore, NOTHING_HELD);

    let (tp, cp) = (FakeComm::new("tp", false), FakeComm::new("cp", false));
    let comms: Vec<Arc<dyn DeviceResources>> = vec![tp.clone(), cp.clone()];
    let rank = ModelRankMemory::new(&memory, be.clone()).with_communicators(comms);
    rank.check(&tags).unwrap();
    let slept = rank.release(&tags).unwrap();
    assert_eq!((slept[0].restore.as_str(), slept[0].allocations), ("reconnect", 2));
    assert!(tp.is_released() && cp.is_released());
    let woke = rank.materialize(&tags).unwrap();
    assert_eq!((woke[0].restore.as_str(), woke[0].allocations), ("reconnect", 2));
    assert!(!tp.is_released() && !cp.is_released());

    for (first_refuses, changed) in [(false, true), (true, false)] {
        let (a, b) = if first_refuses {
            (FakeComm::new("tp", true), FakeComm::new("cp", false))
        } else {
            (FakeComm::new("tp", false), FakeComm::new("cp", true))
        };
        let comms: Vec<Arc<dyn DeviceResources>> = vec![a.clone(), b.clone()];
        let rank = ModelRankMemory::new(&memory, be.clone()).with_communicators(comms);
        let e = rank.release(&tags).unwrap_err();
        let refused = if first_refuses { "tp" } else { "cp" };
        assert!(e.message.contains(&format!("releasing the {refused} communicator")), "{e:?}");
        assert_eq!(e.changed, changed, "{e:?}");
        assert_eq!(a.is_released(), !first_refuses);
        rank.materialize(&tags).unwrap();
        assert!(!a.is_released() && !b.is_released(), "the undo restores what was released");
    }
}
