//! Tests of the GGUF reader: valid files, split models, and every malformed-header refusal
//! with its exact message.

use super::super::testutil::{split_part, valid, B};
use super::*;

const F32: u32 = 0;

fn parse(b: &[u8]) -> Result<GgufFile, GgufError> {
    parse_gguf_bytes(b, "t.gguf")
}

fn err(b: &[u8]) -> GgufError {
    match parse(b) {
        Ok(f) => panic!("expected an error, parsed {f:?}"),
        Err(e) => e,
    }
}

/// A file with the given metadata entries (already encoded) and no tensors.
fn with_kvs(n_kv: u64, kvs: B) -> Vec<u8> {
    B {
        buf: B::new().header(3, 0, n_kv).buf,
    }
    .bytes(&kvs.buf)
    .done()
}

/// A file with no metadata and the given tensor records (already encoded), then padding
/// and `data` bytes of tensor data.
fn with_tensors(n: u64, recs: B, data: usize) -> Vec<u8> {
    B::new()
        .header(3, n, 0)
        .bytes(&recs.buf)
        .pad(32)
        .data(data)
        .done()
}

#[test]
fn valid_v2_and_v3_files_parse() {
    for version in [2, 3] {
        let bytes = valid(version);
        let f = parse(&bytes).unwrap();
        assert_eq!(f.version, version);
        assert_eq!(f.alignment, 32);
        assert_eq!(f.data_offset % 32, 0);
        assert_eq!(f.file_size, bytes.len() as u64);
        assert_eq!(f.data_offset + 64, f.file_size);
        assert_eq!(f.metadata.len(), 4);
        assert_eq!(f.metadata[0].0, "general.architecture", "file order kept");
        assert_eq!(f.get_str("general.architecture").unwrap(), Some("llama"));
        assert_eq!(f.get_u64("llama.block_count").unwrap(), Some(2));
        assert_eq!(f.get_f64("llama.block_count").unwrap(), Some(2.0));
        assert_eq!(f.get_bool("general.flag").unwrap(), Some(true));
        assert_eq!(
            f.get_array("tokenizer.ggml.tokens").unwrap(),
            Some(&GgufArray::Strings(vec![
                "a".into(),
                "bb".into(),
                "".into()
            ]))
        );
        assert_eq!(f.get_u64("absent").unwrap(), None);
        assert_eq!(f.tensors.len(), 2);
        let t = f.tensor("tok_embd.weight").unwrap();
        assert_eq!(
            (t.dims.clone(), t.ggml_type, t.offset, t.bytes, t.part),
            (vec![4, 2], GgmlType::F32, 0, 32, 0)
        );
        assert_eq!(t.n_elements(), 8);
        assert_eq!(
            f.tensor_file_offset(&f.tensors[1]),
            Some(f.data_offset + 32)
        );
        assert_eq!(f.parts.len(), 1);
        assert_eq!(f.parts[0].n_tensors, 2);
    }
}

#[test]
fn typed_getters_refuse_wrong_types_naming_the_key() {
    let b = with_kvs(
        3,
        B::new()
            .kv_raw("neg", vt::I32, &(-5i32).to_le_bytes())
            .kv_raw("small", vt::I8, &[7])
            .kv_str("s", "x"),
    );
    let f = parse(&b).unwrap();
    assert_eq!(f.get_u64("small").unwrap(), Some(7));
    assert_eq!(f.get_f64("neg").unwrap(), Some(-5.0));
    let e = f.get_u64("neg").unwrap_err();
    assert!(matches!(e, GgufError::WrongType { .. }));
    assert!(
        e.to_string().contains("'neg'") && e.to_string().contains("t.gguf"),
        "{e}"
    );
    assert!(f.get_str("small").is_err());
    assert!(f.get_bool("s").is_err());
    assert!(f.get_array("s").is_err());
    assert!(f.get_f64("s").is_err());
}

#[test]
fn every_scalar_type_and_nested_arrays_round_trip() {
    let kvs = B::new()
        .kv_raw("u8", vt::U8, &[200])
        .kv_raw("i8", vt::I8, &[0xFF])
        .kv_raw("u16", vt::U16, &500u16.to_le_bytes())
        .kv_raw("i16", vt::I16, &(-500i16).to_le_bytes())
        .kv_raw("f32", vt::F32, &1.5f32.to_le_bytes())
        .kv_raw("u64", vt::U64, &u64::MAX.to_le_bytes())
        .kv_raw("i64", vt::I64, &(-1i64).to_le_bytes())
        .kv_raw("f64", vt::F64, &2.25f64.to_le_bytes())
        // [[1u32, 2u32], ["x"], []: i64, [[true]]]
        .str("nested")
        .u32(vt::ARRAY)
        .u32(vt::ARRAY)
        .u64(4)
        .u32(vt::U32)
        .u64(2)
        .u32(1)
        .u32(2)
        .u32(vt::STRING)
        .u64(1)
        .str("x")
        .u32(vt::I64)
        .u64(0)
        .u32(vt::ARRAY)
        .u64(1)
        .u32(vt::BOOL)
        .u64(1)
        .u8(1);
    let f = parse(&with_kvs(9, kvs)).unwrap();
    assert_eq!(f.get("u8"), Some(&GgufValue::U8(200)));
    assert_eq!(f.get("i8"), Some(&GgufValue::I8(-1)));
    assert_eq!(f.get("u16"), Some(&GgufValue::U16(500)));
    assert_eq!(f.get("i16"), Some(&GgufValue::I16(-500)));
    assert_eq!(f.get("f32"), Some(&GgufValue::F32(1.5)));
    assert_eq!(f.get_u64("u64").unwrap(), Some(u64::MAX));
    assert_eq!(f.get("i64"), Some(&GgufValue::I64(-1)));
    assert_eq!(f.get_f64("f64").unwrap(), Some(2.25));
    let want = GgufArray::Arrays(vec![
        GgufArray::U32(vec![1, 2]),
        GgufArray::Strings(vec!["x".into()]),
        GgufArray::I64(vec![]),
        GgufArray::Arrays(vec![GgufArray::Bool(vec![true])]),
    ]);
    let got = f.get_array("nested").unwrap().unwrap();
    assert_eq!(got, &want);
    assert_eq!(got.len(), 4);
    assert_eq!(got.elem_type_id(), vt::ARRAY);
    assert_eq!(GgufArray::U32(vec![1, 2]).to_u64_vec(), Some(vec![1, 2]));
    assert_eq!(GgufArray::I32(vec![1, -2]).to_u64_vec(), None);
}

#[test]
fn nesting_deeper_than_the_cap_is_refused() {
    let mut kvs = B::new().str("deep").u32(vt::ARRAY);
    for _ in 0..CAPS.max_array_depth {
        kvs = kvs.u32(vt::ARRAY).u64(1);
    }
    kvs = kvs.u32(vt::U8).u64(0);
    // Every level up to the cap is fine: check the cap itself with one fewer level.
    let mut ok = B::new().str("deep").u32(vt::ARRAY);
    for _ in 0..CAPS.max_array_depth - 1 {
        ok = ok.u32(vt::ARRAY).u64(1);
    }
    ok = ok.u32(vt::U8).u64(0);
    assert!(parse(&with_kvs(1, ok)).is_ok());
    let e = err(&with_kvs(1, kvs));
    assert!(
        matches!(
            e,
            GgufError::TooLarge {
                why: "array nesting depth cap",
                ..
            }
        ),
        "{e}"
    );
}

// ---- one hand-made file per hostile class ----

#[test]
fn hostile_unchecked_string_length() {
    // A key claiming u64::MAX bytes, a value claiming more than the cap, and one that
    // is under the cap but past the end of the file.
    let e = err(&B::new()
        .header(3, 0, 1)
        .u64(u64::MAX)
        .bytes(&[0; 16])
        .done());
    assert!(matches!(e, GgufError::TooLarge { offset: 24, .. }), "{e}");
    let e = err(&with_kvs(
        1,
        B::new()
            .str("k")
            .u32(vt::STRING)
            .u64(CAPS.max_string_len + 1)
            .bytes(&[0; 8]),
    ));
    assert!(
        matches!(
            e,
            GgufError::TooLarge {
                why: "string length cap",
                ..
            }
        ),
        "{e}"
    );
    let e = err(&with_kvs(
        1,
        B::new().str("k").u32(vt::STRING).u64(1000).bytes(b"short"),
    ));
    assert!(
        matches!(
            e,
            GgufError::Truncated {
                need: 1000,
                have: 5,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.field().contains("'k'"), "{}", e.field());
}

#[test]
fn hostile_unchecked_array_count() {
    let e = err(&with_kvs(
        1,
        B::new()
            .str("a")
            .u32(vt::ARRAY)
            .u32(vt::U32)
            .u64(u64::MAX)
            .bytes(&[0; 16]),
    ));
    match e {
        GgufError::TooLarge {
            offset,
            value,
            limit,
            ..
        } => {
            assert_eq!(offset, 24 + 9 + 4 + 4);
            assert_eq!(value, u64::MAX);
            assert_eq!(limit, 4);
        }
        e => panic!("{e}"),
    }
    // Strings: each takes at least 8 bytes, so 3 strings cannot fit in 16 bytes.
    let e = err(&with_kvs(
        1,
        B::new()
            .str("a")
            .u32(vt::ARRAY)
            .u32(vt::STRING)
            .u64(3)
            .bytes(&[0; 16]),
    ));
    assert!(matches!(e, GgufError::TooLarge { limit: 2, .. }), "{e}");
    // Nested arrays: each inner array takes at least 12 bytes.
    let e = err(&with_kvs(
        1,
        B::new()
            .str("a")
            .u32(vt::ARRAY)
            .u32(vt::ARRAY)
            .u64(1 << 40)
            .bytes(&[0; 24]),
    ));
    assert!(matches!(e, GgufError::TooLarge { limit: 2, .. }), "{e}");
}

#[test]
fn hostile_tensor_and_kv_counts() {
    let e = err(&B::new().header(3, u64::MAX, 0).bytes(&[0; 64]).done());
    assert!(
        matches!(
            e,
            GgufError::TooLarge {
                offset: 8,
                limit: 2,
                ..
            }
        ),
        "{e}"
    );
    let e = err(&B::new().header(3, 0, u64::MAX).bytes(&[0; 64]).done());
    assert!(
        matches!(
            e,
            GgufError::TooLarge {
                offset: 16,
                limit: 4,
                ..
            }
        ),
        "{e}"
    );
    // Together: 4 kv x 13 + 1 tensor x 32 > 64.
    let e = err(&B::new().header(3, 1, 4).bytes(&[0; 64]).done());
    assert!(
        matches!(
            e,
            GgufError::TooLarge {
                offset: 8,
                limit: 0,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn hostile_n_dims() {
    let e = err(&with_tensors(
        1,
        B::new().tensor("t", &[1, 1, 1, 1, 1], F32, 0),
        32,
    ));
    assert!(
        matches!(&e, GgufError::BadTensor { field, .. } if field.contains("n_dims")),
        "{e}"
    );
    let e = err(&with_tensors(
        1,
        B::new().str("t").u32(u32::MAX).bytes(&[0; 64]),
        0,
    ));
    assert!(matches!(&e, GgufError::BadTensor { offset: 33, .. }), "{e}");
    let e = err(&with_tensors(1, B::new().tensor("t", &[], F32, 0), 32));
    assert!(
        matches!(&e, GgufError::BadTensor { field, .. } if field.contains("n_dims")),
        "{e}"
    );
    // Four dims is the most ggml has and is fine.
    assert!(parse(&with_tensors(
        1,
        B::new().tensor("t", &[1, 2, 1, 2], F32, 0),
        32
    ))
    .is_ok());
}

#[test]
fn hostile_zero_dimension() {
    let e = err(&with_tensors(1, B::new().tensor("t", &[8, 0], F32, 0), 32));
    assert!(
        matches!(&e, GgufError::BadTensor { field, .. } if field.contains("dims[1]")),
        "{e}"
    );
}

#[test]
fn hostile_element_count_times_type_size_overflow() {
    // 2^32 x 2^32 elements overflows u64; 2^40 x 2^20 is past the 2^50 cap; both would
    // wrap a naive `elements * 4`.
    for dims in [
        &[1u64 << 32, 1 << 32][..],
        &[1 << 40, 1 << 20],
        &[u64::MAX],
        &[1 << 63, 2, 2, 2],
    ] {
        let e = err(&with_tensors(1, B::new().tensor("t", dims, F32, 0), 32));
        assert!(
            matches!(
                e,
                GgufError::TooLarge {
                    why: "element count cap (2^50)",
                    ..
                }
            ),
            "{dims:?}: {e}"
        );
    }
    // At the cap with the largest type: no overflow, just far past the end of the file.
    let e = err(&with_tensors(
        1,
        B::new().tensor("t", &[1 << 25, 1 << 25], 28, 0),
        32,
    ));
    assert!(
        matches!(&e, GgufError::BadTensor { problem, .. } if problem.contains("past the end")),
        "{e}"
    );
}

#[test]
fn hostile_summed_tensor_sizes() {
    // Each tensor fits in the 64-byte data section alone; together they need 96 bytes.
    let recs = B::new()
        .tensor("a", &[8], F32, 0)
        .tensor("b", &[16], F32, 0);
    let e = err(&with_tensors(2, recs, 64));
    assert!(
        matches!(&e, GgufError::TooLarge { value: 96, limit: 64, field, .. } if field.contains("sum")),
        "{e}"
    );
}

#[test]
fn hostile_alignment() {
    let file = |v: u32| {
        B::new()
            .header(3, 1, 1)
            .kv_u32("general.alignment", v)
            .tensor("t", &[8], F32, 0)
            .pad(64)
            .data(64)
            .done()
    };
    for bad in [0, 3, 48, 1 << 21, u32::MAX] {
        let e = err(&file(bad));
        assert!(
            matches!(e, GgufError::BadAlignment { offset, .. } if offset == 24 + 8 + 17 + 4),
            "{bad}: {e}"
        );
    }
    let f = parse(&file(64)).unwrap();
    assert_eq!(f.alignment, 64);
    assert_eq!(f.data_offset, 128);
    let e = err(&with_kvs(1, B::new().kv_str("general.alignment", "32")));
    assert!(matches!(e, GgufError::WrongType { .. }), "{e}");
}

#[test]
fn hostile_offsets_past_end_of_file() {
    let e = err(&with_tensors(
        1,
        B::new().tensor("t", &[8], F32, 1 << 40),
        32,
    ));
    assert!(
        matches!(&e, GgufError::BadTensor { problem, .. } if problem.contains("past the end")),
        "{e}"
    );
    // data_offset + offset overflows u64.
    let e = err(&with_tensors(
        1,
        B::new().tensor("t", &[8], F32, u64::MAX - 31),
        32,
    ));
    assert!(
        matches!(&e, GgufError::BadTensor { problem, .. } if problem.contains("past the end")),
        "{e}"
    );
    // One byte short.
    let e = err(&with_tensors(1, B::new().tensor("t", &[8], F32, 0), 31));
    assert!(matches!(&e, GgufError::BadTensor { .. }), "{e}");
}

#[test]
fn hostile_misaligned_offset() {
    let e = err(&with_tensors(1, B::new().tensor("t", &[4], F32, 16), 64));
    assert!(
        matches!(&e, GgufError::BadTensor { problem, .. } if problem.contains("multiple")),
        "{e}"
    );
}

#[test]
fn hostile_overlapping_tensors() {
    let recs = B::new()
        .tensor("a", &[8], F32, 32)
        .tensor("b", &[16], F32, 0);
    let e = err(&with_tensors(2, recs, 96));
    match &e {
        GgufError::BadTensor {
            field,
            problem,
            offset,
            ..
        } => {
            assert!(field.contains("'a'"), "{field}");
            assert!(problem.contains("overlaps tensor 'b'"), "{problem}");
            assert_eq!(*offset, 24);
        }
        e => panic!("{e}"),
    }
}

#[test]
fn hostile_duplicate_keys_and_tensor_names() {
    let e = err(&with_kvs(
        3,
        B::new().kv_u32("a", 1).kv_u32("b", 2).kv_u32("a", 3),
    ));
    match &e {
        GgufError::Duplicate {
            offset,
            first_offset,
            field,
            ..
        } => {
            assert_eq!(*first_offset, 24);
            assert_eq!(*offset, 24 + 2 * 17);
            assert!(field.contains("'a'"));
        }
        e => panic!("{e}"),
    }
    let recs = B::new()
        .tensor("w", &[8], F32, 0)
        .tensor("w", &[8], F32, 32);
    let e = err(&with_tensors(2, recs, 64));
    assert!(
        matches!(
            &e,
            GgufError::Duplicate {
                first_offset: 24,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn hostile_type_ids() {
    let e = err(&with_kvs(1, B::new().str("k").u32(13).u32(0)));
    assert!(
        matches!(
            e,
            GgufError::BadValueType {
                type_id: 13,
                offset: 33,
                ..
            }
        ),
        "{e}"
    );
    let e = err(&with_kvs(
        1,
        B::new().str("k").u32(vt::ARRAY).u32(99).u64(0),
    ));
    assert!(
        matches!(e, GgufError::BadValueType { type_id: 99, .. }),
        "{e}"
    );
    for id in [4, 31, u32::MAX] {
        let e = err(&with_tensors(1, B::new().tensor("t", &[256], id, 0), 1024));
        assert!(
            matches!(e, GgufError::BadGgmlType { type_id, offset, .. } if type_id == id && offset == 24 + 9 + 4 + 8),
            "{e}"
        );
    }
    // A known block type whose row is not a whole number of blocks.
    let e = err(&with_tensors(
        1,
        B::new().tensor("t", &[100], GgmlType::Q4K.id(), 0),
        1024,
    ));
    assert!(
        matches!(&e, GgufError::BadTensor { problem, .. } if problem.contains("Q4_K")),
        "{e}"
    );
    let f = parse(&with_tensors(
        1,
        B::new().tensor("t", &[256, 2], GgmlType::Q4K.id(), 0),
        288,
    ))
    .unwrap();
    assert_eq!(f.tensors[0].bytes, 288);
}

#[test]
fn hostile_invalid_utf8() {
    let e = err(&with_kvs(1, B::new().raw_str(b"ke\xffy").u32(vt::U8).u8(0)));
    assert!(
        matches!(
            e,
            GgufError::InvalidUtf8 {
                offset: 24,
                bad_at: 34,
                ..
            }
        ),
        "{e}"
    );
    let e = err(&with_kvs(
        1,
        B::new().str("k").u32(vt::STRING).raw_str(b"\xc3\x28"),
    ));
    assert!(matches!(e, GgufError::InvalidUtf8 { .. }), "{e}");
    let e = err(&with_kvs(
        1,
        B::new()
            .str("k")
            .u32(vt::ARRAY)
            .u32(vt::STRING)
            .u64(2)
            .str("ok")
            .raw_str(b"\x80"),
    ));
    assert!(
        matches!(&e, GgufError::InvalidUtf8 { field, .. } if field.ends_with("[1]")),
        "{e}"
    );
    let e = err(&with_tensors(
        1,
        B::new().raw_str(b"\xfe").u32(1).u64(8).u32(F32).u64(0),
        32,
    ));
    assert!(matches!(e, GgufError::InvalidUtf8 { .. }), "{e}");
}

#[test]
fn hostile_bool_bytes() {
    let e = err(&with_kvs(1, B::new().kv_bool("b", 2)));
    assert!(
        matches!(
            e,
            GgufError::BadBool {
                value: 2,
                offset: 37,
                ..
            }
        ),
        "{e}"
    );
    let e = err(&with_kvs(
        1,
        B::new()
            .str("b")
            .u32(vt::ARRAY)
            .u32(vt::BOOL)
            .u64(3)
            .bytes(&[1, 0, 0xff]),
    ));
    assert!(
        matches!(&e, GgufError::BadBool { value: 0xff, field, .. } if field.ends_with("[2]")),
        "{e}"
    );
}

#[test]
fn hostile_truncated_files() {
    let full = valid(3);
    for cut in 0..full.len() {
        let e = err(&full[..cut]);
        if cut < 24 {
            assert!(matches!(e, GgufError::Truncated { .. }), "cut {cut}: {e}");
        }
    }
}

#[test]
fn hostile_magic_and_versions() {
    let mut b = valid(3);
    b[0] = b'X';
    assert!(matches!(err(&b), GgufError::BadMagic { offset: 0, .. }));
    for (v, why) in [
        (1u32, "obsolete"),
        (0x0300_0000, "big-endian"),
        (4, "v2 and v3"),
        (0, "v2 and v3"),
    ] {
        let e = err(&valid(v));
        assert!(
            matches!(&e, GgufError::UnsupportedVersion { version, .. } if *version == v),
            "{e}"
        );
        assert!(e.to_string().contains(why), "{e}");
    }
}

#[test]
fn messages_name_file_offset_and_field() {
    let e = err(&with_kvs(1, B::new().kv_bool("my.flag", 7)));
    let s = e.to_string();
    assert!(
        s.contains("t.gguf") && s.contains("byte 43") && s.contains("my.flag"),
        "{s}"
    );
    assert_eq!((e.file(), e.offset()), ("t.gguf", 43));
    assert!(e.field().contains("my.flag"));
}

#[test]
fn empty_keys_and_names_are_refused() {
    assert!(parse(&with_kvs(1, B::new().kv_u32("", 1))).is_err());
    assert!(parse(&with_tensors(1, B::new().tensor("", &[8], F32, 0), 32)).is_err());
}

// ---- files on disk: mmap and split models ----

#[test]
fn read_gguf_maps_a_single_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.gguf");
    std::fs::write(&p, valid(3)).unwrap();
    let f = read_gguf(&p).unwrap();
    assert_eq!(
        f,
        parse_gguf_bytes(&valid(3), &p.display().to_string()).unwrap()
    );
    std::fs::write(&p, b"").unwrap();
    assert!(matches!(
        read_gguf(&p),
        Err(GgufError::Truncated { offset: 0, .. })
    ));
    let e = read_gguf(&dir.path().join("absent.gguf")).unwrap_err();
    assert!(
        matches!(e, GgufError::Io { .. }) && e.to_string().contains("absent.gguf"),
        "{e}"
    );
}

fn write_split(dir: &Path, count: u16) -> std::path::PathBuf {
    for i in 0..count {
        let name = format!("m-{:05}-of-{:05}.gguf", i + 1, count);
        let t = format!("t{i}");
        std::fs::write(dir.join(name), split_part(i, count, &t, i == 0)).unwrap();
    }
    dir.join(format!("m-00001-of-{count:05}.gguf"))
}

#[test]
fn split_model_reads_as_one() {
    let dir = tempfile::tempdir().unwrap();
    let first = write_split(dir.path(), 3);
    let f = read_gguf(&first).unwrap();
    assert_eq!(f.parts.len(), 3);
    assert_eq!(
        f.tensors
            .iter()
            .map(|t| (t.name.as_str(), t.part))
            .collect::<Vec<_>>(),
        [("t0", 0), ("t1", 1), ("t2", 2)]
    );
    assert!(f.parts[2].path.ends_with("m-00003-of-00003.gguf"));
    assert_eq!(f.get_str("general.architecture").unwrap(), Some("llama"));
    assert_eq!(
        f.tensor_file_offset(&f.tensors[2]),
        Some(f.parts[2].data_offset)
    );
    assert_eq!(f.metadata.len(), 4, "metadata comes from the first part");
}

#[test]
fn split_model_errors_name_the_part() {
    let dir = tempfile::tempdir().unwrap();
    let first = write_split(dir.path(), 3);
    // Giving the second part.
    let e = read_gguf(&dir.path().join("m-00002-of-00003.gguf")).unwrap_err();
    assert!(
        matches!(&e, GgufError::Split { field, .. } if field == "split.no"),
        "{e}"
    );
    // Missing part.
    std::fs::remove_file(dir.path().join("m-00002-of-00003.gguf")).unwrap();
    let e = read_gguf(&first).unwrap_err();
    assert!(
        matches!(&e, GgufError::Split { file, .. } if file.ends_with("m-00002-of-00003.gguf")),
        "{e}"
    );
    assert!(e.to_string().contains("part 2 of 3 is missing"), "{e}");
    // A part that says it is a different part.
    std::fs::write(
        dir.path().join("m-00002-of-00003.gguf"),
        split_part(2, 3, "t1", false),
    )
    .unwrap();
    let e = read_gguf(&first).unwrap_err();
    assert!(
        matches!(&e, GgufError::Split { field, .. } if field == "split.no"),
        "{e}"
    );
    // A tensor name repeated across parts.
    std::fs::write(
        dir.path().join("m-00002-of-00003.gguf"),
        split_part(1, 3, "t0", false),
    )
    .unwrap();
    let e = read_gguf(&first).unwrap_err();
    assert!(
        matches!(&e, GgufError::Duplicate { file, .. } if file.ends_with("m-00002-of-00003.gguf")),
        "{e}"
    );
    // split.count without the naming scheme.
    let renamed = dir.path().join("renamed.gguf");
    std::fs::copy(&first, &renamed).unwrap();
    let e = read_gguf(&renamed).unwrap_err();
    assert!(e.to_string().contains("PREFIX-00001-of-00003.gguf"), "{e}");
    // Split naming without split.count.
    let named = dir.path().join("x-00001-of-00002.gguf");
    std::fs::write(&named, valid(3)).unwrap();
    assert!(matches!(read_gguf(&named), Err(GgufError::Split { .. })));
    // A single-part "split" is just a file.
    let one = dir.path().join("y-00001-of-00001.gguf");
    std::fs::write(&one, split_part(0, 1, "w", true)).unwrap();
    assert_eq!(read_gguf(&one).unwrap().parts.len(), 1);
}

#[test]
fn split_names_parse() {
    assert_eq!(
        split_name(Path::new("/a/Qwen3-Next-00001-of-00003.gguf")),
        Some(("Qwen3-Next".into(), 1, 3))
    );
    assert_eq!(split_name(Path::new("m-1-of-3.gguf")), None);
    assert_eq!(split_name(Path::new("m.gguf")), None);
    assert_eq!(split_name(Path::new("-00001-of-00003.gguf")), None);
}

// ---- mutation fuzzing (bounded; complements the cargo-fuzz targets in fuzz/) ----

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]

    #[test]
    fn mutated_valid_files_never_panic(
        version in 2u32..=3,
        flips in proptest::collection::vec((0usize..4096, proptest::prelude::any::<u8>()), 0..8),
        cut in proptest::option::of(0usize..4096),
    ) {
        let mut b = valid(version);
        for (i, v) in flips {
            let n = b.len();
            b[i % n] = v;
        }
        if let Some(c) = cut {
            b.truncate(c % (b.len() + 1));
        }
        // Must return (Ok or Err) without panicking; an Ok file must satisfy the invariants.
        if let Ok(f) = parse(&b) {
            for t in &f.tensors {
                proptest::prop_assert!(f.data_offset + t.offset + t.bytes <= f.file_size);
                proptest::prop_assert!((1..=4).contains(&t.dims.len()));
                proptest::prop_assert_eq!(t.offset % f.alignment, 0);
            }
        }
    }
}

/// Writes the fuzz seed corpus when STRATA_GGUF_SEED_DIR is set (see FUZZING.md);
/// otherwise only checks that every seed parses.
#[test]
fn seed_corpus() {
    let dir = tempfile::tempdir().unwrap();
    let split = write_split(dir.path(), 2);
    let seeds: Vec<(&str, Vec<u8>)> = vec![
        ("valid_v2", valid(2)),
        ("valid_v3", valid(3)),
        ("split_first", std::fs::read(&split).unwrap()),
        (
            "aligned_64_q4k",
            B::new()
                .header(3, 1, 1)
                .kv_u32("general.alignment", 64)
                .tensor("t", &[256, 2], GgmlType::Q4K.id(), 0)
                .pad(64)
                .data(288)
                .done(),
        ),
    ];
    for (name, bytes) in &seeds {
        assert!(parse(bytes).is_ok(), "{name}");
    }
    if let Some(out) = std::env::var_os("STRATA_GGUF_SEED_DIR") {
        let out = std::path::PathBuf::from(out);
        std::fs::create_dir_all(&out).unwrap();
        for (name, bytes) in &seeds {
            std::fs::write(out.join(name), bytes).unwrap();
        }
    }
}
