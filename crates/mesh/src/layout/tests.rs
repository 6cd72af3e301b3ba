//! Table-driven tests of the mesh arithmetic.

use super::*;

/// Expected ranges as `(start, end)` pairs.
type Spans = &'static [(usize, usize)];

fn spans(ranges: &[Range<usize>]) -> Vec<(usize, usize)> {
    ranges.iter().map(|r| (r.start, r.end)).collect()
}

#[test]
fn balanced_ranges_table() {
    let cases: [(usize, usize, Spans); 8] = [
        (10, 3, &[(0, 4), (4, 7), (7, 10)]),
        (9, 3, &[(0, 3), (3, 6), (6, 9)]),
        (11, 4, &[(0, 3), (3, 6), (6, 9), (9, 11)]),
        (7, 1, &[(0, 7)]),
        (2, 4, &[(0, 1), (1, 2), (2, 2), (2, 2)]),
        (0, 2, &[(0, 0), (0, 0)]),
        (5, 0, &[]),
        (1, 1, &[(0, 1)]),
    ];
    for (total, parts, want) in cases {
        assert_eq!(spans(&balanced_ranges(total, parts)), want, "{total} over {parts}");
    }
}

#[test]
fn balanced_ranges_cover_contiguously_and_evenly() {
    for total in 0..40 {
        for parts in 1..12 {
            let ranges = balanced_ranges(total, parts);
            assert_eq!(ranges.len(), parts);
            assert_eq!(ranges[0].start, 0);
            assert_eq!(ranges[parts - 1].end, total);
            for pair in ranges.windows(2) {
                assert_eq!(pair[0].end, pair[1].start, "{total} over {parts}");
                // Sizes never grow towards the high ranks, and differ by at most one.
                assert!(pair[0].len() >= pair[1].len() && pair[0].len() <= pair[1].len() + 1);
            }
        }
    }
}

#[test]
fn plan_mesh_table() {
    // (world, tp, kv head groups, (tp, cp))
    type Case = (usize, Option<usize>, usize, (usize, usize));
    let cases: [Case; 9] = [
        (1, None, 8, (1, 1)),
        (8, None, 8, (8, 1)),
        (8, None, 4, (4, 2)),
        (6, None, 4, (2, 3)),
        (6, None, 3, (3, 2)),
        (5, None, 8, (1, 5)),
        (4, Some(2), 8, (2, 2)),
        (4, Some(1), 8, (1, 4)),
        (6, Some(2), 3, (2, 3)),
    ];
    for (world, tp, groups, (want_tp, want_cp)) in cases {
        let mesh = plan_mesh(world, tp, groups).unwrap();
        assert_eq!(
            (mesh.tp(), mesh.cp()),
            (want_tp, want_cp),
            "world {world} tp {tp:?} groups {groups}"
        );
        assert_eq!(mesh.world(), world);
    }
}

#[test]
fn plan_mesh_refusals_name_the_numbers() {
    let cases: [(usize, Option<usize>, usize, &str); 5] = [
        (6, Some(4), 8, "tp=4 does not divide world size 6"),
        (
            8,
            Some(4),
            3,
            "tp=4 exceeds the 3 kv head groups of the model: a head group cannot be split",
        ),
        (0, None, 8, "world size must be at least 1"),
        (4, Some(0), 8, "tp=0"),
        (4, None, 0, "0 kv head groups"),
    ];
    for (world, tp, groups, want) in cases {
        let msg = plan_mesh(world, tp, groups).unwrap_err().to_string();
        assert!(msg.contains(want), "world {world} tp {tp:?} groups {groups}: {msg}");
    }
}

#[test]
fn coordinates_put_tp_innermost() {
    let mesh = DeviceMesh::new(2, 3).unwrap();
    let cases = [(0, (0, 0)), (1, (1, 0)), (2, (0, 1)), (3, (1, 1)), (4, (0, 2)), (5, (1, 2))];
    for (rank, (t, c)) in cases {
        assert_eq!(mesh.coords(rank).unwrap(), (t, c), "rank {rank}");
        assert_eq!(mesh.rank_of(t, c).unwrap(), rank);
    }
    for (got, want) in [
        (mesh.coords(6).map(drop), "rank 6 is outside the mesh tp=2 x cp=3"),
        (mesh.rank_of(2, 0).map(drop), "tp rank 2 is outside"),
        (mesh.rank_of(0, 3).map(drop), "cp rank 3 is outside"),
        (mesh.tp_group(3).map(drop), "cp rank 3"),
        (mesh.cp_group(2).map(drop), "tp rank 2"),
        (DeviceMesh::new(0, 2).map(drop), "tp=0 x cp=2"),
    ] {
        let msg = got.unwrap_err().to_string();
        assert!(msg.contains(want), "{msg}");
    }
}

#[test]
fn groups_table() {
    // ((tp, cp), tp groups, cp groups)
    type Groups = &'static [&'static [usize]];
    let cases: [((usize, usize), Groups, Groups); 4] = [
        ((2, 3), &[&[0, 1], &[2, 3], &[4, 5]], &[&[0, 2, 4], &[1, 3, 5]]),
        ((4, 1), &[&[0, 1, 2, 3]], &[&[0], &[1], &[2], &[3]]),
        ((1, 3), &[&[0], &[1], &[2]], &[&[0, 1, 2]]),
        ((1, 1), &[&[0]], &[&[0]]),
    ];
    for ((tp, cp), tp_groups, cp_groups) in cases {
        let mesh = DeviceMesh::new(tp, cp).unwrap();
        assert_eq!(mesh.tp_groups(), tp_groups, "{mesh}");
        assert_eq!(mesh.cp_groups(), cp_groups, "{mesh}");
        for (c, group) in tp_groups.iter().enumerate() {
            assert_eq!(mesh.tp_group(c).unwrap(), *group);
        }
        for (t, group) in cp_groups.iter().enumerate() {
            assert_eq!(mesh.cp_group(t).unwrap(), *group);
        }
        for rank in 0..mesh.world() {
            let (t, c) = mesh.coords(rank).unwrap();
            assert_eq!(mesh.tp_group_of(rank).unwrap(), tp_groups[c]);
            assert_eq!(mesh.cp_group_of(rank).unwrap(), cp_groups[t]);
        }
    }
}

#[test]
fn token_shard_table() {
    // (tokens, cp size, cp rank, local range, sizes)
    type Case = (usize, usize, usize, Range<usize>, &'static [usize]);
    let cases: [Case; 6] = [
        (10, 3, 0, 0..4, &[4, 3, 3]),
        (10, 3, 1, 4..7, &[4, 3, 3]),
        (10, 3, 2, 7..10, &[4, 3, 3]),
        (8, 2, 1, 4..8, &[4, 4]),
        (3, 3, 2, 2..3, &[1, 1, 1]),
        (5, 1, 0, 0..5, &[5]),
    ];
    for (tokens, cp, rank, local, sizes) in cases {
        let shard = TokenShard::new(tokens, cp, rank).unwrap();
        assert_eq!(shard.local(), local, "{tokens} tokens, cp {cp}, rank {rank}");
        assert_eq!(shard.sizes(), sizes);
        assert_eq!(shard.total(), tokens);
        assert_eq!(shard.rank(), rank);
        assert_eq!(shard.ranges(), balanced_ranges(tokens, cp));
        let all: Vec<usize> = (100..100 + tokens).collect();
        let want: Vec<usize> = local.map(|i| 100 + i).collect();
        assert_eq!(shard.select(&all).unwrap(), want);
    }
}

#[test]
fn token_shard_refusals() {
    let cases: [(usize, usize, usize, &str); 4] = [
        (2, 3, 0, "3 cp ranks for 2 tokens: every cp rank needs at least one token"),
        (0, 1, 0, "1 cp ranks for 0 tokens"),
        (4, 0, 0, "cp size must be at least 1"),
        (4, 2, 2, "cp rank 2 is not below the cp size 2"),
    ];
    for (tokens, cp, rank, want) in cases {
        let msg = TokenShard::new(tokens, cp, rank).unwrap_err().to_string();
        assert!(msg.contains(want), "{msg}");
    }
    let shard = TokenShard::new(4, 2, 0).unwrap();
    let msg = shard.select(&[1, 2, 3]).unwrap_err().to_string();
    assert!(msg.contains("3 items given for a sequence of 4 tokens"), "{msg}");
}
